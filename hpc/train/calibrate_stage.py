"""The calibrate stage: fit the confidence head's calibration on rows training never saw.

Training keeps every `train.hold_out_every`-th prepared row out (`split_held_out`). Behind it,
this stage starts the verifier on one node as a streamer does, captures those rows, runs the
exported draft over them teacher-forced as training does, and fits a Platt map per decoding
mode and drafted position (`hpc.model.calibrate`). The map goes into the export, atomically,
where the eval jobs behind this stage read it.

The figure it reports is cross-fitted: the held-out rows are split in two halves and each half
is scored by the map fitted on the other, so the ECE printed is what the stored map (fitted on
both halves) reads on rows it has not seen. The greedy event is read off the row, so it is
exact on data regenerated at temperature 0 (`data.regen_temperature`), which is the default.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from hpc.config.schema import DSparkConfig
from hpc.errors import UserError
from hpc.model.calibrate import MODES, Calibration, HeldOutSlots, concat_slots, cross_fitted_ece, held_out_slots
from hpc.model.loss import PackedRow
from hpc.tables import text_table

CaptureFn = Callable[[int, list[int], list[int]], object]


@dataclass
class Fitted:
    calibration: Calibration
    rows: int
    # per mode, (ECE, effective slot count) per position, cross-fitted; None with a single row
    ece: dict[str, list[tuple[float, float]]] | None
    greedy_floor: list[float]  # the ECE a perfectly calibrated head reads at each position's count


def _packed(capture: CaptureFn, rows: dict, ids: list[int], device: torch.device,
            advance: Callable[[], None]) -> Iterator[PackedRow]:
    from hpc.errors import VerifierDown
    from hpc.stream.streamer import MAX_CONSECUTIVE_FAILURES  # the stream's rule for a broken verifier
    from hpc.train.loop import pack

    streak = 0
    for i in ids:
        advance()
        try:
            cap = capture(i, *rows[i])
        except VerifierDown:
            raise
        except Exception as err:  # noqa: BLE001 - one bad capture costs its row, as in the stream
            streak += 1
            print(f"calibrate: row {i} skipped: {str(err).splitlines()[0]}", flush=True)
            if streak >= MAX_CONSECUTIVE_FAILURES:
                raise UserError(f"calibrate: {streak} captures failed in a row, last: {err}") from None
            continue
        streak = 0
        row = pack([cap])  # type: ignore[list-item]
        yield row if device.type == "cpu" else PackedRow(
            row.input_ids_T.to(device), row.loss_mask_T.to(device), row.aux_TnH.to(device),
            row.last_hidden_TH.to(device), None if row.doc_ids_T is None else row.doc_ids_T.to(device),
            None if row.position_ids_T is None else row.position_ids_T.to(device))


def fit_held_out(model, head, capture: CaptureFn, rows: dict, device: torch.device | str = "cpu",
                 autocast: torch.dtype | None = None, quiet: bool = False) -> Fitted:
    """Capture `rows`, fit on all of them, report ECE cross-fitted on their two halves."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from hpc.evaluate.calibration import ece_floor
    from hpc.model.calibrate import calibrated, fit_calibration

    device = torch.device(device)
    model.eval()
    ids = sorted(rows)
    halves = [h for h in (ids[0::2], ids[1::2]) if h]
    parts: list[HeldOutSlots] = []
    with Progress(TextColumn("calibrate: capturing held-out rows"), BarColumn(), MofNCompleteColumn(),
                  TimeRemainingColumn(), disable=quiet) as bar:
        task = bar.add_task("rows", total=len(ids))
        for half in halves:  # the precision training ran in: bf16 autocast on GPU
            with torch.autocast(device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                try:
                    parts.append(held_out_slots(model, _packed(capture, rows, half, device,
                                                               lambda: bar.advance(task)), head))
                except ValueError as err:  # no row of this half had a drafted slot
                    raise UserError(f"calibrate: {err}; held-out rows {half[:5]}{'...' if len(half) > 5 else ''} "
                                    "gave none (captures skipped above, or rows with no assistant tokens)") from None
    slots = concat_slots(parts)
    cal = fit_calibration(slots)
    ece = cross_fitted_ece(*parts) if len(parts) == 2 else None
    floors = []
    greedy = calibrated(slots, cal, "greedy")
    for k in range(1, int(slots.position.max()) + 1):  # greedy reach is 0/1: these are plain slots
        at = (slots.position == k) & (slots.reach["greedy"] > 0)
        confs = torch.sigmoid(greedy.logit[at]).tolist()
        # Fewer draws on many slots (Kimi's held-out rows): the floor is small and steady there.
        floors.append(ece_floor(confs, draws=max(10, min(200, 1_000_000 // max(1, len(confs))))))
    return Fitted(cal, len(ids), ece, floors)


def format_fitted(f: Fitted) -> str:
    lines = [f"confidence calibration fitted on {f.rows} held-out rows ({f.calibration.fitted_on} drafted slots)"]
    if f.ece is None:
        return "\n".join([*lines, "one held-out row: no cross-fitted ECE (hold out more rows to measure it)"])
    lines.append("ECE per position, cross-fitted (each half of the rows scored by the map fitted on the other); "
                 "'floor' is what a perfectly calibrated head reads at that count")
    table = []
    for k, ((eg, wg), (es, ws)) in enumerate(zip(f.ece["greedy"], f.ece["sampling"]), start=1):
        cell = lambda e, w: "-" if w <= 0 else f"{e:.3f}"  # noqa: E731
        table.append([str(k), f"{wg:.0f}", cell(eg, wg), f"{f.greedy_floor[k - 1]:.3f}" if wg > 0 else "-",
                      f"{ws:.1f}", cell(es, ws)])
    lines += text_table(["pos", "greedy slots", "greedy ECE", "floor", "sampling weight", "sampling ECE"], table,
                        right=range(6))
    return "\n".join(lines)


def metrics(f: Fitted) -> dict[str, float]:
    out = {"calibration_rows": float(f.rows), "calibration_slots": float(f.calibration.fitted_on)}
    for mode in MODES if f.ece else ():
        for k, (e, w) in enumerate(f.ece[mode], start=1):  # type: ignore[index]
            if w > 0:
                out[f"ece_{mode}_pos{k}"] = e
    return out


def calibrate_export(cfg: DSparkConfig, quiet: bool = False) -> dict[str, float]:
    """Fit the calibration of train.output_dir/export on the held-out rows and store it there.
    Returns the metrics to log; {} when there is nothing to calibrate (said in one line)."""
    from hpc.dist.planes import rank_device
    from hpc.model.export import is_export, load_draft
    from hpc.model.loss import VerifierHead
    from hpc.train.driver import make_capture
    from hpc.train.online import autocast_dtype
    from hpc.train.prepare import PREPARED, load_prepared, split_held_out
    from hpc.train.target_weights import load_target_tensors

    out = Path(cfg.train.output_dir)
    export = out / "export"
    if not is_export(export):
        raise UserError(f"{export}: no exported draft to calibrate; the train stage must finish first "
                        f"(dspark stage train CONFIG)")
    every = cfg.train.hold_out_every
    if not every:
        print("calibrate: train.hold_out_every is 0, no rows were held out; nothing to calibrate", flush=True)
        return {}
    prepared = out / "data" / PREPARED
    trained_with = json.loads(prepared.read_text())["settings"].get("hold_out_every", 0) if prepared.is_file() \
        else every
    if trained_with != every:  # other rows than training held out: some were trained on
        raise UserError(f"train.hold_out_every = {every}, but {out} was trained holding out every "
                        f"{trained_with}-th row; calibrate with train.hold_out_every={trained_with}")
    rows, _ = load_prepared(out)
    held = split_held_out(rows, every)[1]
    if not held:
        print(f"calibrate: {len(rows)} prepared rows, none held out at train.hold_out_every={every}; "
              f"the export stays uncalibrated (use a smaller hold_out_every)", flush=True)
        return {}
    if not (cfg.data.regenerate and cfg.data.regen_temperature == 0):
        print("calibrate: warning: the held-out rows are not the target's own greedy output (data.regenerate is "
              "false or data.regen_temperature > 0), so the greedy map is fitted against the rows' tokens, not "
              "against what greedy decoding accepts; regenerate at temperature 0 for an exact one", flush=True)
    # The node's last GPU, as a streamer's: vLLM's TP rank 0 on GPU 0 stages the capture copies.
    # There the draft gets what vLLM leaves (1 - verifier.gpu_memory_utilization), so it is held in
    # the training dtype (bf16: Kimi's draft is 6.3 GB) and run under autocast as training does.
    device = rank_device(cfg.train.device, local=max(cfg.cluster.gpus_per_node - 1, 0))
    amp = autocast_dtype(cfg.train, device)
    draft = load_draft(export, device=str(device), dtype=amp or torch.float32)
    if draft.confidence_head is None:
        print(f"calibrate: {export} has no confidence head; nothing to calibrate", flush=True)
        return {}
    t = load_target_tensors(cfg.verifier.model)
    head = VerifierHead(t["lm_head"].float(), draft.t2d.cpu(),
                        t["norm"].float() if cfg.train.apply_verifier_norm else None).to(device)
    capture, server = make_capture(cfg, str(device), out)
    try:
        fitted = fit_held_out(draft, head, capture, held, device, amp, quiet=quiet)
    finally:
        if server is not None:
            server.close()
    path = fitted.calibration.save(export)
    print(format_fitted(fitted), flush=True)
    print(f"calibrate: wrote {path}", flush=True)
    return metrics(fitted)
