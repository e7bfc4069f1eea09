"""What trainer rank 0 tells the world: a progress line, `progress.json` for `dspark status`,
the MLflow run (params, metrics, artifacts), and at the end the export vLLM serves and the
loss curve. Only rank 0 reports; every other rank trains silently."""

from __future__ import annotations

import json
import time
from pathlib import Path

from omegaconf import OmegaConf
from rich.progress import BarColumn, TextColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress

from hpc.config import flatten
from hpc.config.schema import DSparkConfig
from hpc.config.secrets import redacted
from hpc.formats.checkpoint_layout import latest_checkpoint
from hpc.fsio import write_text
from hpc.model.export import export_draft, load_draft
from hpc.track.keys import STAGE, STAGE_TRAIN
from hpc.track.logger import RunLogger
from hpc.track.pipeline import common_tags
from hpc.track.plots import loss_curve_png


class Progress:
    """Step, loss, samples/s, data-wait share and ETA on one line (rich), for trainer rank 0."""

    def __init__(self, total: int, global_batch: int):
        self.bar = RichProgress(TextColumn("[bold]train"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                                TextColumn("{task.fields[info]}"), TimeRemainingColumn())
        self.task = self.bar.add_task("train", total=total, completed=0, info="")
        self.total = total
        self.global_batch = global_batch
        # The step this job started from is known at its first step only (a resume happens after
        # this is made): counting from 0, a run resumed at 5000 credited 5000 steps to its first second.
        self.t0 = time.monotonic()
        self.start: int | None = None
        # From the first step's end on, the rate is the steady one: the first step holds the
        # verifier's start (minutes for a 1T target) and the first sample's wait, which would
        # otherwise weigh on the rate, the data-wait share and the ETA for the whole run.
        self.first: tuple[int, float, float] | None = None  # (step, time, data wait so far)
        self.bar.start()

    def update(self, step: int, m: dict) -> dict:
        now, wait = time.monotonic(), m.get("data_wait_s", 0.0)
        if self.start is None:
            self.start = step - 1
        if self.first is None:
            self.first = (step, now, wait)
            done, elapsed, waited = step - self.start, max(now - self.t0, 1e-6), wait
        else:
            done, elapsed, waited = step - self.first[0], max(now - self.first[1], 1e-6), wait - self.first[2]
        rate = done * self.global_batch / elapsed
        steps_per_s = done / elapsed
        extra = {"samples_per_s": rate, "data_wait_fraction": waited / elapsed,
                 "eta_s": (self.total - step) / steps_per_s if steps_per_s > 0 else float("nan")}
        self.bar.update(self.task, completed=step, info=f"loss {m.get('loss', float('nan')):.3f}  "
                        f"acc_len {m.get('accept_len', 0):.2f}  "
                        + (f"teacher {m['teacher_agreement']:.0%}  " if "teacher_agreement" in m else "")
                        + f"{rate:.1f} samples/s  "
                        f"wait {extra['data_wait_fraction']:.0%}")
        return extra

    def close(self) -> None:
        self.bar.stop()


_last_progress = [0.0]


def write_progress(path: Path, step: int, total: int, m: dict) -> None:
    """What `dspark status` shows for a running job: at most every 2 s, atomically."""
    now = time.monotonic()
    if now - _last_progress[0] < 2.0 and step != total:
        return
    _last_progress[0] = now
    data = {"step": step, "total": total, "loss": m.get("loss"), "samples_per_s": m.get("samples_per_s"),
            "data_wait_fraction": m.get("data_wait_fraction"), "eta_s": m.get("eta_s"), "updated": time.time()}
    write_text(path, json.dumps(data))


class TrainReport:
    """Rank 0's reporting for one training job: opened before the first step, closed after the last."""

    def __init__(self, cfg: DSparkConfig, out: Path, parent_run_id: str | None = None):
        self.cfg, self.out = cfg, out
        self.logger = RunLogger(cfg.tracking.uri, cfg.tracking.experiment, f"train-{cfg.name}", parent_run_id,
                                tags={STAGE: STAGE_TRAIN, **common_tags(cfg)})
        try:
            public = OmegaConf.structured(redacted(cfg))  # params and the artifact: no secrets
            self.logger.log_params(flatten(public))
            stats_file = out / "data" / "stats.json"
            if stats_file.is_file():  # skipped rows are counted once, by the preparing process
                self.logger.log_metrics(json.loads(stats_file.read_text()), step=0)
            resolved = out / "config.yaml"
            resolved.write_text(OmegaConf.to_yaml(public))
            self.logger.log_artifact(str(resolved))
            self.progress = Progress(cfg.train.steps, cfg.train.global_batch_size)
        except BaseException as err:  # the caller never gets this report to end: end its run here
            self._end_run(err)
            raise

    def on_step(self, step: int, metrics: dict) -> None:
        metrics.update(self.progress.update(step, metrics))
        self.logger.log_metrics({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step)
        write_progress(self.out / "progress.json", step, self.cfg.train.steps, metrics)

    def finish(self, export: bool = True, status: str = "FINISHED") -> None:
        """Export the last checkpoint for vLLM, plot the loss curve, hand both to MLflow.

        Not after a preemption or a failure: an eval must never pick up a half-trained draft.
        """
        self.progress.close()
        cfg, out, logger = self.cfg, self.out, self.logger
        ckpt = latest_checkpoint(out / "checkpoints") if export else None
        if ckpt is not None:
            archs = json.loads((ckpt / "config.json").read_text())["speculators_config"]["verifier"]["architectures"]
            exported = export_draft(load_draft(ckpt), out / "export", cfg.verifier.name or cfg.verifier.model, archs,
                                    max(cfg.eval.num_speculative_tokens))
            losses = json.loads((ckpt / "state.json").read_text())["losses"]
            png = loss_curve_png(losses, out / "loss_curve.png", title=cfg.name)
            logger.log_artifact(str(png))
            logger.log_artifact(str(exported / "config.json"), "export")
            logger.log_artifact(str(exported / "model.safetensors"), "export")
            print(f"exported {ckpt.name} -> {exported}", flush=True)
        if not logger.close(timeout_s=30, status=status):
            print(f"tracking server unreachable ({logger.last_error}); metrics kept only in {out}", flush=True)

    def end_on_error(self, err: BaseException) -> None:
        """The run ends FAILED (KILLED for an interrupt) with its buffer sent, unless it was
        already being closed when the error came."""
        self.progress.close()
        self._end_run(err)

    def _end_run(self, err: BaseException) -> None:
        if not self.logger.closed:
            # A short wait: the other ranks' launcher stops this one a few seconds after they fail.
            self.logger.close(timeout_s=10, status="KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED")
