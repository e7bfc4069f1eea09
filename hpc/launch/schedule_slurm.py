"""Where a retraining schedule lives on Slurm: a scrontab block, or a self-resubmitting job.

scrontab is Slurm's own cron, but sites must enable it (`ScronParameters=enable`). Where it is
off, one small job per schedule waits for the next cron time (`--begin`), runs the tick and
submits its successor; `--dependency=singleton` keeps it to one running job per name.
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hpc.errors import UserError
from hpc.fsio import unsafe_ancestor, write_text
from hpc.launch.job_files import read_published
from hpc.launch.slurm import SlurmMissing, cancel, run_slurm, slurm_why

JOB_PREFIX = "dspark-schedule-"
TICK_TIME = "00:30:00"  # a tick only fingerprints the data and submits: minutes at most
TIMEOUT_S = 60.0


class ScrontabUnavailable(Exception):
    """scrontab is missing or disabled on this cluster: use the job fallback."""


@dataclass(frozen=True)
class Entry:
    """One schedule: what runs, when, and where its tick job goes."""

    name: str
    cron: str
    config: str  # absolute: the tick runs from cron, not from the user's shell
    # The overrides travel in this 0600 file (write_overrides), never on a command line: the
    # scrontab line, sbatch --wrap and each tick's argv are readable by every user of the node.
    overrides_file: str | None = None
    partition: str = "gpu"
    account: str | None = None
    cwd: str = "."
    python: str = "python3"
    log_dir: str = "runs/slurm/schedule"

    def dspark(self, command: str, *extra: str) -> str:
        via = ["--overrides-file", self.overrides_file] if self.overrides_file else []
        return shlex.join([self.python, "-m", "hpc", command, self.config, *via, *extra])

    def tick_command(self) -> str:
        return f"cd {shlex.quote(self.cwd)} && {self.dspark('retrain-tick')}"

    def resubmitting_command(self) -> str:
        # The successor goes in before the tick: a tick that fails (MLflow down), outlives the
        # job's time limit or loses its node must not end the schedule; --dependency=singleton
        # keeps the successor from starting beside it. The job exits with the tick's status, or
        # 1 when the successor could not be submitted.
        again = self.dspark("schedule", "--cron", self.cron, "--resubmit")
        cd = f"cd {shlex.quote(self.cwd)} || exit 1"
        return f"{cd}; {again}; sub=$?; {self.dspark('retrain-tick')}; rc=$?; [ $sub -eq 0 ] || exit 1; exit $rc"

    def log_file(self) -> str:
        return str(Path(self.log_dir) / f"{self.name}-%j.out")


OVERRIDES_SUFFIX = ".overrides.json"


def write_overrides(log_dir: str, name: str, overrides: list[str]) -> str | None:
    """The schedule's overrides in an owner-only file beside its logs (None when there are none)."""
    path = Path(log_dir) / f"{name}{OVERRIDES_SUFFIX}"
    if not overrides:
        path.unlink(missing_ok=True)
        return None
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if (why := unsafe_ancestor(path.parent)) is not None:
        raise UserError(f"cluster.log_dir: {why}; the schedule's overrides (secrets among them) would sit where "
                        "another user can swap them; use a log_dir of your own")
    write_text(path, json.dumps({"overrides": list(overrides)}), mode=0o600)
    return str(path)


def read_overrides(path: str) -> list[str]:
    """What write_overrides wrote; refused (one line) unless it is an owner-only file of ours."""
    try:
        payload = read_published(Path(path))
    except FileNotFoundError:
        raise UserError(f"--overrides-file {path}: no such file; re-install the schedule (dspark schedule CONFIG "
                        "KEY=VALUE ...)") from None
    overrides = payload.get("overrides") if isinstance(payload, dict) else None
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise UserError(f"--overrides-file {path}: not a schedule's overrides file; re-install the schedule")
    return overrides


# ---- scrontab --------------------------------------------------------------------------------


def begin_marker(name: str) -> str:
    return f"# dspark-schedule {name} begin"


def end_marker(name: str) -> str:
    return f"# dspark-schedule {name} end"


def read_scrontab() -> str:
    """This user's table ('' when there is none); ScrontabUnavailable where scrontab is off."""
    try:
        res = run_slurm(["scrontab", "-l"], check=False, timeout=TIMEOUT_S)
    except SlurmMissing:
        raise ScrontabUnavailable("scrontab is not installed") from None
    if res.returncode == 0:
        return res.stdout
    out = res.stdout + res.stderr
    if "disabled" in out:
        raise ScrontabUnavailable(slurm_why(res))
    if "no crontab" in out:
        return ""
    raise UserError(f"scrontab -l failed: {slurm_why(res)}; check `scrontab -l` on this login node")


def write_scrontab(table: str) -> None:
    with tempfile.NamedTemporaryFile("w", prefix="dspark-scrontab-", suffix=".txt", delete=False) as f:
        f.write(table)
    try:
        res = run_slurm(["scrontab", f.name], check=False, timeout=TIMEOUT_S)
    finally:
        os.unlink(f.name)
    if res.returncode != 0:
        if "disabled" in res.stdout + res.stderr:
            raise ScrontabUnavailable(slurm_why(res))
        raise UserError(f"scrontab refused the table: {slurm_why(res)}; check the schedule's config and cron")


def _one_line(what: str, value: str, option: bool = False) -> None:
    """Refuse what would break out of its line in the crontab: a newline ends the entry and the
    next line is another (cron runs it); cron turns `%` in a command into a newline; an option's
    space starts another option."""
    bad = {"\n", "\r", "%"} if not option else {"\n", "\r", " ", "\t"}
    found = sorted(ch for ch in bad if ch in value)
    if found:
        raise UserError(f"schedule: {what} = {value!r} holds {', '.join(map(repr, found))}, which would break its "
                        "scrontab line; rename it, or run the schedule from a path without them")


def scrontab_block(e: Entry) -> list[str]:
    for what, value in (("the current directory", e.cwd), ("the config path", e.config),
                        ("the Python interpreter", e.python), ("the overrides file", e.overrides_file or "")):
        _one_line(what, value)
    for what, value in (("schedule name", e.name), ("cluster.partition", e.partition),
                        ("cluster.account", e.account or ""), ("cluster.log_dir", e.log_dir)):
        _one_line(what, value, option=True)
    opts = [f"-p {e.partition}", *([f"-A {e.account}"] if e.account else []), f"-t {TICK_TIME}",
            f"-o {e.log_file()}"]
    return [begin_marker(e.name), *(f"#SCRON {o}" for o in opts), f"{e.cron} {e.tick_command()}",
            end_marker(e.name)]


def replace_block(table: str, name: str, block: list[str] | None) -> str:
    """`table` with NAME's block replaced by `block` (appended if absent, dropped if None)."""
    lines = table.splitlines()
    begin, end = begin_marker(name), end_marker(name)
    if begin in lines and end in lines[lines.index(begin):]:
        i = lines.index(begin)
        j = lines.index(end, i)
        lines[i:j + 1] = block or []
    elif block:
        lines.extend(block)
    return "\n".join(lines) + "\n" if lines else ""


def _block_lines(table: str) -> Iterator[tuple[str, list[str]]]:
    """(NAME, the line's words) for every line inside a dspark block of `table`."""
    name = None
    for line in table.splitlines():
        words = line.split()
        if line.startswith("# dspark-schedule ") and len(words) == 4:
            name = words[2] if words[3] == "begin" else None
        elif name and words:
            yield name, words


def scrontab_entries(table: str) -> dict[str, str]:
    """NAME -> cron of every dspark block in `table`."""
    return {name: " ".join(words[:5]) for name, words in _block_lines(table) if not words[0].startswith("#")}


def scrontab_log_dirs(table: str) -> dict[str, str]:
    """NAME -> the directory of its tick logs (its `#SCRON -o` line), where its last tick's record is."""
    return {name: str(Path(words[2]).parent) for name, words in _block_lines(table)
            if words[:2] == ["#SCRON", "-o"] and len(words) == 3}


def install_scrontab(e: Entry) -> None:
    Path(e.log_dir).mkdir(parents=True, exist_ok=True)  # Slurm cannot open -o in a missing directory
    write_scrontab(replace_block(read_scrontab(), e.name, scrontab_block(e)))


def remove_scrontab(name: str) -> bool:
    """Drop NAME's block; False when there was none (or scrontab is unavailable)."""
    try:
        table = read_scrontab()
    except ScrontabUnavailable:
        return False
    if name not in scrontab_entries(table):
        return False
    rest = replace_block(table, name, None)
    if rest.strip():
        write_scrontab(rest)
    else:
        run_slurm(["scrontab", "-r"], timeout=TIMEOUT_S,
                  failed="scrontab -r failed: {why}; remove the block by hand with scrontab -e")
    return True


# ---- the self-resubmitting job ---------------------------------------------------------------


@dataclass(frozen=True)
class ScheduleJob:
    job_id: str
    name: str  # the schedule's name, without the prefix
    state: str
    start: str  # squeue StartTime: the BeginTime of a pending job
    log_dir: str = ""  # the directory of its StdOut: the schedule's log_dir, where its last tick's record is


SQUEUE_FIELDS = "JobID:|,Name:|,State:|,StartTime:|,STDOUT:"  # the last field a path: it may hold a "|"


def schedule_jobs(name: str | None = None) -> list[ScheduleJob]:
    """This user's dspark-schedule-* jobs (only NAME's when given)."""
    res = run_slurm(["squeue", "--me", "-h", "-O", SQUEUE_FIELDS], timeout=TIMEOUT_S,
                    missing="squeue not found; run dspark schedule on a Slurm login node", failed="squeue failed: {why}")
    jobs = []
    for line in res.stdout.splitlines():
        parts = [p.strip() for p in line.strip().split("|", 4)]
        if len(parts) == 5 and parts[1].startswith(JOB_PREFIX):
            job = ScheduleJob(parts[0], parts[1][len(JOB_PREFIX):], parts[2], parts[3], str(Path(parts[4]).parent))
            if name is None or job.name == name:
                jobs.append(job)
    return jobs


def submit_singleton(e: Entry, begin: datetime.datetime) -> str:
    """sbatch the tick job that starts at `begin`; returns its id."""
    Path(e.log_dir).mkdir(parents=True, exist_ok=True)
    argv = ["sbatch", "--parsable", f"--job-name={JOB_PREFIX}{e.name}", "--dependency=singleton",
            f"--begin={begin.strftime('%Y-%m-%dT%H:%M:%S')}", "-p", e.partition,
            *(["-A", e.account] if e.account else []), "-t", TICK_TIME, "-N", "1", "-n", "1",
            f"--output={e.log_file()}", f"--chdir={e.cwd}",
            f"--wrap={e.resubmitting_command()}"]
    res = run_slurm(argv, timeout=TIMEOUT_S, missing="sbatch not found; run dspark schedule on a Slurm login node",
                    failed="sbatch refused the schedule job: {why}; check cluster.partition / cluster.account")
    return res.stdout.strip().split(";")[0]


def cancel_jobs(jobs: list[ScheduleJob]) -> None:
    cancel([j.job_id for j in jobs])
