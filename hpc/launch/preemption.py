"""The preemption drill's record: what each part of the window took on this cluster, beside what
`dspark plan` models for it.

Node 0 writes it after its requeue (the window's last part), from the lines every rank appended
(hpc.train.preempt_clock), to train.output_dir/preemption.json, and prints one line. Run a drill on
a cluster with `scancel --signal=USR2 JOB` against a training job: the record then says whether
cluster.signal_delay_s holds there, and which part to put a measured figure on.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from hpc.config.schema import DSparkConfig
from hpc.fsio import write_text
from hpc.train import preempt_clock as clock

RECORD = "preemption.json"
PARTS = (clock.BOUNDARY, clock.CHECKPOINT, clock.STREAM_STOP, clock.VERIFIER_STOP, clock.REQUEUE)


def modelled_window(cfg: DSparkConfig) -> dict[str, tuple[float, str]]:
    """The plan's window for this config, {part: (seconds, how)}; empty if the plan cannot be made
    here (a drill records what it measured either way)."""
    from hpc.launch.plan import capacity_plan  # the plan's arithmetic: only when a drill ends

    try:
        pipeline = capacity_plan(cfg).pipeline
    except Exception:  # noqa: BLE001 - the measurement must not be lost to the model
        return {}
    return {what: (s, how) for what, s, how in pipeline.window} if pipeline is not None else {}


def requeue_timed(cfg: DSparkConfig, requeue: Callable[[], None], exit_code: int,
                  variants: list[DSparkConfig] | None = None) -> None:
    """Node 0's requeue, timed to the job's end: `scontrol requeue` has Slurm end the job at once
    (TERM to every task), often before the command returns here. So the record is written from
    that TERM (the window's true end), or after the command if it returns first. `variants`: the
    drafts of a shared verifier's allocation, whose trainers mark their parts in their own
    directories; the record (in `cfg`'s) is the slowest of them all."""
    others = [Path(v.train.output_dir) for v in variants or [] if v.train.output_dir != cfg.train.output_dir]
    model = modelled_window(cfg)  # before the clock starts: the plan's import and arithmetic
    t0 = time.time()
    state = {"writing": False}

    def finish(until: str) -> None:
        if not state["writing"]:
            state["writing"] = True
            print(record_window(cfg, time.time() - t0, model, until, others), flush=True)

    def on_term(_signum, _frame):
        # Slurm's TERM often comes twice (slurmstepd's, then srun's as it forces the step down).
        # One that lands while the record is being written, here or below this frame, must let
        # that write finish: exiting from it left a torn temporary file and no record.
        if state["writing"]:
            return
        finish("to Slurm's TERM that ended the job")
        os._exit(exit_code)
    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        requeue()
        finish("the scontrol call; the job ended after it")
    finally:
        signal.signal(signal.SIGTERM, previous)


def record_window(cfg: DSparkConfig, requeue_s: float, model: dict[str, tuple[float, str]], until: str,
                  others: list[Path] | None = None) -> str:
    """Write this attempt's record, from the marks in `cfg`'s directory and `others`; returns its one line."""
    out = Path(cfg.train.output_dir)
    attempt = clock.attempt()
    try:
        marks = [m for d in [out, *(others or [])] for m in clock.read_marks(d, attempt)]
    except PermissionError as err:
        return f"preemption window not recorded: {err}"
    marks.append({"part": clock.REQUEUE, "s": requeue_s, "until": until})
    parts = []
    for part in PARTS:
        mine = [m for m in marks if m.get("part") == part]
        measured = max((float(m["s"]) for m in mine), default=None)  # the slowest rank's is the window's
        entry: dict = {"part": part, "measured_s": measured, "modelled_s": model.get(part, (None, ""))[0],
                       "how_modelled": model.get(part, (None, ""))[1]}
        size = max((m["bytes"] for m in mine if m.get("bytes")), default=None)
        if size and measured:
            entry.update(bytes=size, gbytes_s=size / 1e9 / measured)
        for key in ("backend", "until"):
            if (said := next((m[key] for m in mine if m.get(key)), None)) is not None:
                entry[key] = said
        parts.append(entry)
    signals = [float(m["at"]) for m in marks if m.get("part") == clock.SIGNAL and "at" in m]
    total = time.time() - min(signals) if signals else None
    rec = {"attempt": attempt, "signal_delay_s": cfg.cluster.signal_delay_s, "signal_to_requeue_s": total,
           "modelled_window_s": sum(p["modelled_s"] or 0.0 for p in parts) or None, "parts": parts}
    write_text(out / RECORD, json.dumps(rec, indent=2) + "\n", mode=0o600)
    return window_line(rec, cfg.cluster.signal_delay_s, out / RECORD)


def window_line(rec: dict, signal_delay_s: float, where: Path) -> str:
    """A record's one line for the job log."""
    said = ", ".join(f"{p['part']} {p['measured_s']:.2f} s" if p["measured_s"] is not None else f"{p['part']} -"
                     for p in rec["parts"])
    total = rec.get("signal_to_requeue_s")
    whole = f"; signal to requeue {total:.1f} s" if total is not None else ""
    return (f"preemption window (attempt {rec['attempt']}): {said}{whole}, of cluster.signal_delay_s = "
            f"{signal_delay_s} s; beside the plan's model in {where}")


def last_window(cfg: DSparkConfig, restart: int) -> str | None:
    """The previous attempt's line, for the requeued job's log. Node 0 prints it at the requeue
    too, but from inside a step that Slurm is ending: that copy can be lost with the step's output
    (the record on disk is not)."""
    path = Path(cfg.train.output_dir) / RECORD
    if not restart or not path.is_file() or path.stat().st_uid != os.getuid():
        return None  # no requeue, no record, or a record this user did not write
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if rec.get("attempt") != restart - 1 or not isinstance(rec.get("parts"), list):
        return None  # an older job's record, or not ours to read
    return window_line(rec, cfg.cluster.signal_delay_s, path)
