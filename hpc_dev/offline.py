"""Single-process training with an in-process verifier: for tests, quick CPU runs and the
DFlash/vLLM parity checks. The trainer is the online pipeline's (`Trainer.from_config`); only
the samples come from an HF verifier in this process instead of the stream."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from hpc.calibration.stage import calibration_rows_for, fit_held_out, format_fitted
from hpc.config.schema import DSparkConfig
from hpc.data.prepare import load_prepared, prepare_data, split_held_out
from hpc.errors import UserError
from hpc.formats.checkpoint_layout import latest_checkpoint
from hpc.model.export import as_served
from hpc.train.epochs import local_micro_batches
from hpc.train.trainer import Trainer
from hpc.verifier.hf_backend import HFVerifier

if TYPE_CHECKING:
    from hpc.calibration.stage import Fitted


def train_in_process(cfg: DSparkConfig, out_dir: str | Path | None = None, steps: int | None = None,
                     on_step: Callable[[int, dict], None] | None = None,
                     on_calibrated: Callable[[Fitted], None] | None = None) -> Path:
    """Prepare data, train on one rank with an HF verifier, return the last checkpoint.

    With `train.hold_out_every` > 0 those rows train nobody. Afterwards the confidence head's
    calibration is fitted on the rows the calibrate stage picks (`calibration_rows_for`:
    `data.calibration_sources`, else the held-out ones) as that stage fits it, and saved beside
    the last checkpoint so that its export carries it, and handed to `on_calibrated` with its
    figures."""
    out_dir = Path(out_dir or cfg.train.output_dir)
    train_cfg = copy.deepcopy(cfg.train)
    if steps is not None:
        train_cfg.steps = steps
        train_cfg.warmup_steps = min(train_cfg.warmup_steps, max(steps // 10, 1))
    train_cfg.ranks_per_node = 1
    prepare_data(cfg, out_dir)
    rows, vocab_file = load_prepared(out_dir)
    rows = split_held_out(rows, cfg.train.hold_out_every)[0]
    trainer = Trainer.from_config(cfg, out_dir, vocab_file=vocab_file, train=train_cfg, epoch_size=len(rows))
    model, head = trainer.model, trainer.head
    verifier = HFVerifier(cfg.verifier.model, list(cfg.verifier.aux_layer_ids), cfg.verifier.final_hidden.value,
                          trust_remote_code=cfg.verifier.trust_remote_code)
    batches = local_micro_batches(verifier, rows, trainer.micro_batch_size, 0, 1, train_cfg.seed,
                                  trainer.state.ledger, trainer.state.epoch)
    trainer.run(batches, on_step=on_step)
    ckpt = latest_checkpoint(trainer.ckpt_dir)
    if ckpt is None:
        raise UserError(f"training wrote no checkpoint under {trainer.ckpt_dir} (train.steps={train_cfg.steps})")
    if model.confidence_head is None:  # DFlash and Markov-only: nothing to calibrate
        return ckpt
    cal_rows, where = calibration_rows_for(cfg, out_dir)  # the calibrate stage's choice of rows, and its lines
    if cal_rows:
        # Fitted on the weights the export serves, as the calibrate stage fits on the export.
        fitted = fit_held_out(as_served(model), head, verifier.capture, cal_rows, quiet=True, where=where,
                              ns=cfg.eval.num_speculative_tokens, fold=cfg.eval.fold.value)
        fitted.calibration.save(ckpt)
        print(format_fitted(fitted), flush=True)
        if on_calibrated is not None:
            on_calibrated(fitted)
    return ckpt
