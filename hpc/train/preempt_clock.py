"""The preemption window as it runs: each part node 0 must finish between Slurm's signal and the
job's end, timed where it happens and appended to one file in train.output_dir.

`dspark plan` models the window (hpc.launch.plan_time); this is the measurement beside it. Every
process that takes part appends its own lines (one `write` each, O_APPEND: whole lines from
several processes); node 0 reads them after its requeue and writes the record
(hpc.launch.preemption). A requeued job is a new attempt (SLURM_RESTART_COUNT), so each line names
its attempt and an attempt's record reads only its own.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from hpc import fsio

MARKS = "preemption-marks.jsonl"
# The parts, in the order they happen; the names are the plan's (hpc.launch.plan_time's window).
BOUNDARY, CHECKPOINT, STREAM_STOP, VERIFIER_STOP, REQUEUE = (
    "reach a step boundary", "write the checkpoint", "streamer STOP", "vLLM shutdown", "requeue")
SIGNAL = "signal"  # not a part: when a trainer rank got USR2/TERM (its `at`, wall clock)


def attempt() -> int:
    return int(os.environ.get("SLURM_RESTART_COUNT") or 0)


def mark(out_dir: str | Path, part: str, seconds: float, **extra: object) -> None:
    """Append one measured part; never raises (a clock must not fail the requeue it times)."""
    line = json.dumps({"attempt": attempt(), "part": part, "s": round(seconds, 4), "host": socket.gethostname(),
                       "pid": os.getpid(), **extra}) + "\n"
    try:
        fd = os.open(Path(out_dir) / MARKS, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError:
        pass


def read_marks(out_dir: str | Path, of_attempt: int) -> list[dict]:
    """This attempt's lines; a torn last line (a process killed mid-write) is skipped. Raises
    PermissionError when the file fails the owner check (it decides nothing, but is shown)."""
    path = Path(out_dir) / MARKS
    if not path.exists():
        return []
    out = []
    for line in fsio.read_trusted(path).splitlines():
        try:
            m = json.loads(line)
        except ValueError:
            continue
        if isinstance(m, dict) and m.get("attempt") == of_attempt:
            out.append(m)
    return out
