"""`dspark schedule CONFIG [KEY=VALUE ...] --cron "0 3 * * 0"`: scheduled retraining.

Installs one entry per config `name`: a scrontab block where the cluster enables scrontab,
else a self-resubmitting `dspark-schedule-NAME` job that waits for the next cron time. Each
firing runs `dspark retrain-tick`, which submits the whole pipeline only when the training
data changed since the last scheduled run (its fingerprint is a tag on that run's parent),
warm-started from the registry's champion when there is one (schedule.warm_start_from_champion).
The new draft replaces the champion only if it is better: evaluation registers every draft
and moves the `champion` alias only on a strictly higher acceptance length on the same
benchmark manifests (hpc/track/registry.py); a worse retrain is registered, never served.

    dspark schedule --list          every schedule: scrontab blocks and pending tick jobs
    dspark schedule --remove NAME   drop NAME's scrontab block and cancel its tick job
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

from hpc.errors import UserError
from hpc.fsio import read_trusted
from hpc.launch.cron import HINT, local_zone, next_run, parse_cron
from hpc.launch.launch_checks import resolve
from hpc.launch.retrain import LAST_SUFFIX, retrain_tick, watch
from hpc.launch.schedule_slurm import (
    Entry,
    ScrontabUnavailable,
    cancel_jobs,
    install_scrontab,
    read_overrides,
    read_scrontab,
    remove_scrontab,
    schedule_jobs,
    scrontab_entries,
    scrontab_log_dirs,
    submit_singleton,
    write_overrides,
)

# ---- install, list, remove -------------------------------------------------------------------


def check_cron(cron: str | None) -> str:
    if not cron:
        raise UserError("schedule.cron is not set: pass --cron '0 3 * * 0' or set schedule.cron in the config")
    # One line of five fields: a newline would end the crontab entry and start another.
    bad = sorted({ch for ch in cron if not (ch.isascii() and (ch.isalnum() or ch in "*/,- "))})
    if bad:
        raise UserError(f"schedule.cron = {cron!r}: characters {''.join(bad)!r} have no place in a cron "
                        "expression; use five space-separated fields on one line, e.g. '0 3 * * 0'")
    try:
        parse_cron(cron)
    except ValueError as err:
        raise UserError(f"schedule.cron = {cron!r}: {err}; use {HINT}") from None
    return cron


def install(config: str, overrides: list[str], cron: str | None = None, resubmit: bool = False) -> int:
    cfg = resolve(config, overrides, check_tracking=not resubmit)
    cron = check_cron(cron or cfg.schedule.cron)
    c = cfg.cluster
    log_dir = str((Path(c.log_dir) / "schedule").resolve())
    e = Entry(cfg.name, cron, str(Path(config).resolve()), write_overrides(log_dir, cfg.name, list(overrides)),
              c.partition, c.account, str(Path.cwd()), sys.executable, log_dir)
    if not resubmit:
        try:
            install_scrontab(e)
            print(f"schedule {e.name}: scrontab entry '{cron}' runs `dspark retrain-tick` (see scrontab -l)")
            return 0
        except ScrontabUnavailable as why:
            print(f"scrontab unavailable ({why}); using a self-resubmitting job instead")
    this_job = os.environ.get("SLURM_JOB_ID")
    waiting = [j for j in schedule_jobs(e.name) if j.state == "PENDING" and j.job_id != this_job]
    if resubmit and waiting:  # someone re-installed while this tick ran: theirs stands
        print(f"schedule {e.name}: job {waiting[0].job_id} is already waiting; not resubmitting")
        return 0
    cancel_jobs(waiting)  # a re-install replaces the waiting job
    # Aware: a naive now() in the hour the autumn change repeats cannot say which pass it is in.
    begin = next_run(cron, datetime.datetime.now(local_zone()))
    job_id = submit_singleton(e, begin)
    print(f"schedule {e.name}: job {job_id} runs `dspark retrain-tick` at {begin:%Y-%m-%d %H:%M} ('{cron}'), "
          f"then resubmits itself; logs in {e.log_dir}")
    return 0


def last_tick(log_dir: str, name: str) -> str:
    """A schedule's trigger and its last tick's decision, from the record the tick left."""
    path = Path(log_dir) / f"{name}{LAST_SUFFIX}"
    if not os.path.lexists(path):
        return "no tick yet"
    try:  # what a user reads as their schedule's decision: only a record of theirs
        rec = json.loads(read_trusted(path))
    except PermissionError as err:
        return f"last tick record not trusted ({err})"
    except (OSError, ValueError) as err:
        return f"last tick record unreadable ({err})"
    try:
        when = datetime.datetime.fromtimestamp(float(rec.get("at", 0))).strftime("%Y-%m-%d %H:%M")
        said = " / ".join(str(x) for x in rec.get("lines") or ["nothing said"])
    except (AttributeError, TypeError, ValueError, OverflowError, OSError) as err:
        return f"last tick record unreadable ({err})"
    return f"trigger {rec.get('trigger', '?')}; last tick {when}: {said}"


def list_schedules() -> str:
    try:
        table = read_scrontab()
    except ScrontabUnavailable:
        table = ""
    blocks, logs = scrontab_entries(table), scrontab_log_dirs(table)
    lines = [f"{name:<24} scrontab  '{cron}'  {last_tick(logs.get(name, ''), name)}"
             for name, cron in sorted(blocks.items())]
    lines += [f"{j.name:<24} job {j.job_id:<8} {j.state.lower():<8} starts {j.start}  {last_tick(j.log_dir, j.name)}"
              for j in schedule_jobs()]
    return "\n".join(lines) + "\n" if lines else "no scheduled retraining (see dspark schedule --help)\n"


def remove(name: str) -> int:
    removed = remove_scrontab(name)
    jobs = schedule_jobs(name)
    cancel_jobs(jobs)
    if not removed and not jobs:
        raise UserError(f"--remove {name}: no schedule of that name; `dspark schedule --list` shows them")
    what = (["its scrontab block"] if removed else []) + [f"job {j.job_id}" for j in jobs]
    print(f"schedule {name}: removed " + ", ".join(what))
    return 0


# ---- CLI -------------------------------------------------------------------------------------


def _schedule_cmd(a) -> int:
    if a.list:
        print(list_schedules(), end="")
        return 0
    if a.remove:
        return remove(a.remove)
    if not a.config:
        raise UserError("dspark schedule: give a CONFIG to schedule, --list, or --remove NAME")
    return install(a.config, _overrides(a), a.cron, a.resubmit)


def _overrides(a) -> list[str]:
    """A schedule's saved overrides (--overrides-file: how its own commands pass them), then argv's."""
    return [*(read_overrides(a.overrides_file) if a.overrides_file else []), *a.overrides]


_FILE_HELP = "read KEY=VALUE overrides from this owner-only JSON file (what a schedule's own commands use)"


def register_schedule(sub) -> None:
    p = sub.add_parser("schedule", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    p.add_argument("--cron", help="when to check for new data, e.g. '0 3 * * 0' (default: schedule.cron)")
    p.add_argument("--list", action="store_true", help="show every installed schedule")
    p.add_argument("--remove", metavar="NAME", help="remove the schedule of the config named NAME")
    p.add_argument("--resubmit", action="store_true", help=argparse.SUPPRESS)  # the tick job's successor
    p.add_argument("--overrides-file", help=_FILE_HELP)
    p.set_defaults(func=_schedule_cmd)


def _config_command(p: argparse.ArgumentParser, run) -> None:
    """CONFIG [KEY=VALUE ...] [--overrides-file F] -> run(config, overrides): a schedule's own commands."""
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    p.add_argument("--overrides-file", help=_FILE_HELP)
    p.set_defaults(func=lambda a: run(a.config, _overrides(a)))


def register_tick(sub) -> None:
    p = sub.add_parser("retrain-tick", help="one tick of a schedule (what the scrontab entry runs)",
                       description="One tick of a `dspark schedule`, by schedule.trigger: submit the pipeline if "
                       "data.sources changed since the last scheduled run (cron), or if the served draft drifted "
                       "(drift: the `dspark watch` tick), else say so and submit nothing.")
    _config_command(p, retrain_tick)


def register_watch(sub) -> None:
    p = sub.add_parser("watch", help="one tick of the serving watch: live acceptance against the champion's",
                       description="Read the /metrics of serve.endpoints, judge the spec-decode counters since the "
                       "last tick against the champion's evaluated acceptance length at the served n, log the point "
                       "to MLflow, and submit the warm-started retrain when drift holds for serve.window ticks.")
    _config_command(p, watch)
