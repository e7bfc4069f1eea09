"""A scheduled tick: submit the warm-started pipeline when the evidence asks for it.

schedule.trigger says which evidence counts:
- cron: the training data changed since the last scheduled run (its fingerprint is a tag on that
  run's parent);
- drift: the served draft's live acceptance fell below the line (hpc/watch; `dspark watch`);
- both: either.
Whatever fires, the retrain is the same pipeline, warm-started from the registry's champion
(schedule.warm_start_from_champion), and its parent run records why it ran. A pipeline still
running, or one that failed schedule.retries times in a row on this data, holds the next one back.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hpc.config.schema import DataConfig, DSparkConfig, SourceKind, Trigger
from hpc.errors import UserError
from hpc.fsio import write_text
from hpc.launch.launch_checks import resolve
from hpc.track.keys import CONFIG_NAME, STAGE, STAGE_PIPELINE
from hpc.track.registry import CHAMPION
from hpc.track.rest import not_found, tracking_client
from hpc.track.store import missing_store
from hpc.watch.drift import Verdict
from hpc.watch.evaluated import NoChampion, champion_at
from hpc.watch.tick import TickResult, load_state, save_state, served_n, state_path, watch_tick

SCHEDULED, FINGERPRINT = "dspark.scheduled", "dspark.data_fingerprint"
TRIGGERED = "dspark.trigger"  # on a scheduled pipeline run: cron (new data) or drift
LAST_SUFFIX = ".last.json"  # a schedule's last tick: its trigger and what it decided
HASH_LIMIT = 64 << 20  # bigger files count by size and mtime only: a tick must stay cheap


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
        kind = "" if s.kind == SourceKind.rows else f" {s.kind.value} {s.max_age_days}"  # rows: as before
        h.update(f"source {s.split} {s.max_rows}{kind}\n".encode())
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
    try:
        return str(client.get_model_version_by_alias(model_name, CHAMPION).version)
    except Exception as err:
        if not_found(err):  # no such model, or no champion yet
            return None
        raise


def _warm_start(cfg: DSparkConfig, client, fingerprint: str) -> tuple[list[str], dict[str, str]]:
    """The overrides and tags every scheduled retrain gets, whatever fired it."""
    extra: list[str] = []
    tags = {SCHEDULED: "true", FINGERPRINT: fingerprint}
    champ = champion_version(client, cfg.tracking.registered_model)
    if cfg.schedule.warm_start_from_champion and champ and not cfg.train.init_from:
        extra.append("train.init_from=champion")
        tags["dspark.warm_start"] = f"{cfg.tracking.registered_model} v{champ}"
    if cfg.data.regenerate:
        # A finished regeneration is reused as it is: new data needs a directory of its own.
        extra.append(f"data.output_dir={Path(cfg.data.output_dir) / f'data-{fingerprint[:12]}'}")
    return extra, tags


def say(said: list[str], line: str) -> None:
    """Print a tick's decision and keep it for the schedule's record (`dspark schedule --list`)."""
    print(line, flush=True)
    said.append(line)


def submit_retrain(config: str, overrides: list[str], cfg: DSparkConfig, client, fingerprint: str, why: str,
                   tags: dict[str, str], said: list[str]) -> int:
    extra, base = _warm_start(cfg, client, fingerprint)
    warm = f", warm start from {base['dspark.warm_start']}" if "dspark.warm_start" in base else ""
    say(said, f"{why}{warm}: submitting the pipeline")
    from hpc.launch.submit import submit  # the whole launcher: loaded only when a tick submits

    return submit(config, [*overrides, *extra], extra_tags={**base, **tags})


def data_tick(config: str, overrides: list[str], cfg: DSparkConfig, client, fingerprint: str,
              said: list[str]) -> int:
    """Submit the pipeline if the data changed since the last scheduled run."""
    last = last_scheduled_run(client, cfg)
    # A pipeline that failed on this data did not cover it: the tick retries. One a person
    # cancelled (`dspark cancel` ends it KILLED) is left cancelled until the data changes.
    if last is not None and last.fingerprint == fingerprint:
        if last.status != "FAILED":
            say(said, f"no new data since {last.name} (run {last.run_id})")
            return 0
        if last.failures > cfg.schedule.retries:
            say(said, f"{last.failures} pipelines in a row failed on this data, the last {last.name} "
                f"(run {last.run_id}); not submitting again (schedule.retries={cfg.schedule.retries}) until the "
                "data changes: fix the cause and `dspark submit` it by hand")
            return 0
        say(said, f"{last.name} (run {last.run_id}) ended {last.status} on this data: submitting it again")
    return submit_retrain(config, overrides, cfg, client, fingerprint, f"new data (fingerprint {fingerprint[:12]})",
                          {TRIGGERED: "cron"}, said)


def held_back(cfg: DSparkConfig, last: LastRun | None, fingerprint: str) -> str | None:
    """Why a drift retrain must wait: one under way, or the retry limit on this data."""
    if last is None:
        return None
    if last.status == "RUNNING":
        return f"a retrain is under way ({last.name}, run {last.run_id}); not submitting another"
    if last.status == "FAILED" and last.fingerprint == fingerprint and last.failures > cfg.schedule.retries:
        return (f"{last.failures} pipelines in a row failed on this data, the last {last.name} (run {last.run_id}); "
                f"not submitting again (schedule.retries={cfg.schedule.retries}): fix the cause first")
    return None


def evidence_tags(cfg: DSparkConfig, verdict: Verdict) -> dict[str, str]:
    """What the retrain's parent run records about why it ran. The endpoints carry no credentials
    (validate refuses a URL with any); the token is never in a tag."""
    e = verdict.evidence
    since = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(e["since"]))
    return {TRIGGERED: "drift", "dspark.drift.live_tau": f"{e['live_tau']:.4f}",
            "dspark.drift.evaluated_tau": f"{e['eval_tau']:.4f}", "dspark.drift.ratio": str(e["ratio"]),
            "dspark.drift.window": f"{e['window']} ticks since {since}", "dspark.drift.drafts": str(e["drafts"]),
            "dspark.drift.champion": f"{cfg.tracking.registered_model} v{e['champion']}",
            "dspark.drift.endpoints": ",".join(cfg.serve.endpoints)[:4000]}


def drift_tick(config: str, overrides: list[str], cfg: DSparkConfig, client, fingerprint: str,
               said: list[str], now: float | None = None) -> tuple[int, TickResult]:
    """One watch tick; a fired verdict submits the retrain unless one is held back. The state is
    saved after acting, with the fire undone when nothing was submitted: the streak stands."""
    path = state_path(cfg)
    state = load_state(path)
    last_fire = state.last_fire
    result = watch_tick(cfg, client, state, now)
    for line in result.lines():
        say(said, line)
    v = result.verdict
    rc, submitted = 0, False
    try:
        if v.fire:
            why = held_back(cfg, last_scheduled_run(client, cfg), fingerprint)
            if why:
                say(said, why)
            else:
                rc = submit_retrain(config, overrides, cfg, client, fingerprint,
                                    f"drift (live tau {v.evidence['live_tau']:.3f} < {cfg.serve.drift_ratio} x "
                                    f"{v.evidence['eval_tau']:.3f})", evidence_tags(cfg, v), said)
                submitted = rc == 0
    finally:
        if v.fire and not submitted:
            state.streak, state.last_fire = v.streak, last_fire
        save_state(path, state)
    return rc, result


def record_path(cfg: DSparkConfig) -> Path:
    """Where a schedule's ticks leave their last decision: beside its logs and overrides."""
    return Path(cfg.cluster.log_dir).resolve() / "schedule" / f"{cfg.name}{LAST_SUFFIX}"


def retrain_tick(config: str, overrides: list[str], now: float | None = None) -> int:
    """One firing of a schedule, by schedule.trigger: drift first (its evidence goes on the run),
    then new data; one retrain at most, since a running one holds the next back."""
    cfg = resolve(config, overrides)
    fingerprint = data_fingerprint(cfg.data)
    # A drift tick only reads the store: one that is missing, empty or corrupt is a line, never
    # created. New data may start the first pipeline, which makes the store as `submit` would.
    store = missing_store(cfg.tracking.uri)
    client = None if store and cfg.schedule.trigger == Trigger.drift else tracking_client(cfg.tracking.uri)
    rc, said = 0, list[str]()
    try:
        if cfg.schedule.trigger in (Trigger.drift, Trigger.both) and store:
            say(said, f"watch: {store}")
            rc = 1
        elif cfg.schedule.trigger in (Trigger.drift, Trigger.both):
            try:
                rc, _ = drift_tick(config, overrides, cfg, client, fingerprint, said, now)
            except UserError as err:  # no champion to compare with, a token missing: the data may still count
                say(said, f"watch: {err}")
                rc = 1
        if cfg.schedule.trigger in (Trigger.cron, Trigger.both):
            rc = data_tick(config, overrides, cfg, client, fingerprint, said) or rc
    finally:
        record = {"trigger": cfg.schedule.trigger.value, "at": time.time() if now is None else now, "lines": said}
        path = record_path(cfg)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_text(path, json.dumps(record), mode=0o600)
    return rc


def watch(config: str, overrides: list[str]) -> int:
    """`dspark watch`: one tick of the serving watch, as a drift schedule runs it."""
    cfg = resolve(config, overrides)
    if not cfg.serve.endpoints:
        raise UserError("serve.endpoints is empty: list the vLLM servers that serve the champion under serve: "
                        "(docs/retraining.md, \"On drift\")")
    if (why := missing_store(cfg.tracking.uri)) is not None:  # a reader: never creates the store
        raise UserError(why)
    rc, _ = drift_tick(config, overrides, cfg, tracking_client(cfg.tracking.uri), data_fingerprint(cfg.data), [])
    return rc


def check_champion(cfg: DSparkConfig) -> str | None:
    """For `dspark validate`: a drift trigger needs the champion evaluated at the served n. With
    trigger both and no champion yet, new data trains the first one: a warning, not an error."""
    if cfg.schedule.trigger == Trigger.cron:
        return None
    try:
        champion_at(tracking_client(cfg.tracking.uri), cfg.tracking.registered_model, served_n(cfg))
    except NoChampion as err:
        if cfg.schedule.trigger == Trigger.both:
            print(f"warning: {err}; until one is, only new data triggers a retrain", file=sys.stderr)
            return None
        return str(err)
    except UserError as err:
        return str(err)
    return None
