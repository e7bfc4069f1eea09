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
import hashlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from hpc.config import resolve
from hpc.config.cron import HINT, local_zone, next_run, parse_cron
from hpc.config.schema import DataConfig, DSparkConfig
from hpc.errors import UserError
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
    submit_singleton,
    write_overrides,
)
from hpc.launch.submit import submit
from hpc.track.keys import CONFIG_NAME, STAGE, STAGE_PIPELINE
from hpc.track.registry import CHAMPION

SCHEDULED, FINGERPRINT = "dspark.scheduled", "dspark.data_fingerprint"
HASH_LIMIT = 64 << 20  # bigger files count by size and mtime only: a tick must stay cheap


# ---- has the data changed? -------------------------------------------------------------------


def _hash_file(h, path: Path) -> None:
    st = path.stat()
    h.update(f"file {path} {st.st_size} {st.st_mtime_ns}\n".encode())
    if st.st_size < HASH_LIMIT:
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)


def hub_revision(dataset: str) -> str:
    """The hub's current commit of a dataset id, so new uploads count as new data."""
    try:
        from huggingface_hub import HfApi  # optional: its absence is handled here

        return HfApi().dataset_info(dataset, timeout=20).sha or "unresolved"
    except Exception:  # noqa: BLE001 - offline clusters: the id alone is the fingerprint
        return "unresolved"


def data_fingerprint(data: DataConfig) -> str:
    """sha256 over the configured data sources: files by path, size, mtime and content (directories
    file by file in sorted order), hub ids by id, split and revision.

    These are the sources a pipeline trains on (hpc.data.prepare.training_sources). When data
    is regenerated, the regenerated shards are our own output, so the inputs are what counts.
    """
    h = hashlib.sha256()
    for s in data.sources:
        path = Path(s.path).expanduser()
        h.update(f"source {s.split} {s.max_rows}\n".encode())
        if path.is_dir():
            for f in sorted(p for p in path.resolve().rglob("*") if p.is_file()):
                _hash_file(h, f)
        elif path.is_file():
            _hash_file(h, path.resolve())
        else:
            h.update(f"hub {s.path} {s.split} {hub_revision(s.path)}\n".encode())
    return h.hexdigest()


@dataclass(frozen=True)
class LastRun:
    run_id: str
    name: str
    fingerprint: str | None
    status: str = "FINISHED"  # the parent run's: RUNNING while its pipeline is under way
    failures: int = 0  # newest scheduled runs in a row that FAILED on this fingerprint


def last_scheduled_run(client, cfg: DSparkConfig) -> LastRun | None:
    """The newest scheduled pipeline run of this config in the experiment."""
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    if exp is None:
        return None
    runs = client.search_runs([exp.experiment_id], f"tags.`{SCHEDULED}` = 'true' and tags.`{STAGE}` = '{STAGE_PIPELINE}'",
                              order_by=["attributes.start_time DESC"], max_results=200)
    mine = [r for r in runs if r.data.tags.get(CONFIG_NAME) == cfg.name]
    if not mine:
        return None
    run, fp = mine[0], mine[0].data.tags.get(FINGERPRINT)
    failures = 0
    while failures < len(mine) and mine[failures].info.status == "FAILED" \
            and mine[failures].data.tags.get(FINGERPRINT) == fp:
        failures += 1
    return LastRun(run.info.run_id, run.info.run_name or run.info.run_id, fp, run.info.status, failures)


def champion_version(client, model_name: str) -> str | None:
    from mlflow.exceptions import MlflowException  # mlflow: loaded only on this path

    try:
        return str(client.get_model_version_by_alias(model_name, CHAMPION).version)
    except MlflowException:  # no such model, or no champion yet
        return None


def retrain_tick(config: str, overrides: list[str]) -> int:
    """One firing: submit the pipeline if the data changed since the last scheduled run."""
    from mlflow.tracking import MlflowClient  # mlflow: loaded only on this path

    cfg = resolve(config, overrides)
    fingerprint = data_fingerprint(cfg.data)
    client = MlflowClient(cfg.tracking.uri)
    last = last_scheduled_run(client, cfg)
    # A pipeline that failed on this data did not cover it: the tick retries. One a person
    # cancelled (`dspark cancel` ends it KILLED) is left cancelled until the data changes.
    if last is not None and last.fingerprint == fingerprint:
        if last.status != "FAILED":
            print(f"no new data since {last.name} (run {last.run_id})")
            return 0
        if last.failures > cfg.schedule.retries:
            print(f"{last.failures} pipelines in a row failed on this data, the last {last.name} (run {last.run_id}); "
                  f"not submitting again (schedule.retries={cfg.schedule.retries}) until the data changes: "
                  "fix the cause and `dspark submit` it by hand")
            return 0
        print(f"{last.name} (run {last.run_id}) ended {last.status} on this data: submitting it again")
    extra: list[str] = []
    tags = {SCHEDULED: "true", FINGERPRINT: fingerprint}
    champ = champion_version(client, cfg.tracking.registered_model)
    if cfg.schedule.warm_start_from_champion and champ and not cfg.train.init_from:
        extra.append("train.init_from=champion")
        tags["dspark.warm_start"] = f"{cfg.tracking.registered_model} v{champ}"
    if cfg.data.regenerate:
        # A finished regeneration is reused as it is: new data needs a directory of its own.
        extra.append(f"data.output_dir={Path(cfg.data.output_dir) / f'data-{fingerprint[:12]}'}")
    warm = f", warm start from {tags['dspark.warm_start']}" if "dspark.warm_start" in tags else ""
    print(f"new data (fingerprint {fingerprint[:12]}{warm}): submitting the pipeline")
    return submit(config, [*overrides, *extra], extra_tags=tags)


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


def list_schedules() -> str:
    try:
        blocks = scrontab_entries(read_scrontab())
    except ScrontabUnavailable:
        blocks = {}
    lines = [f"{name:<24} scrontab  '{cron}'" for name, cron in sorted(blocks.items())]
    lines += [f"{j.name:<24} job {j.job_id:<8} {j.state.lower():<8} starts {j.start}" for j in schedule_jobs()]
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


def register_tick(sub) -> None:
    p = sub.add_parser("retrain-tick", help="one tick of a schedule (what the scrontab entry runs)",
                       description="One tick of a `dspark schedule`: submit the pipeline if data.sources changed "
                       "since the last scheduled run (by fingerprint), else say so and submit nothing.")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    p.add_argument("--overrides-file", help=_FILE_HELP)
    p.set_defaults(func=lambda a: retrain_tick(a.config, _overrides(a)))
