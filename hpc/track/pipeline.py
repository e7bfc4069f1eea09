"""One MLflow parent run per pipeline, child runs per stage, and the tags every run carries.

The parent is created on the login node at submit time; stages running in other processes
or Slurm jobs attach to it by id (`mlflow.parentRunId`).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from omegaconf import OmegaConf

from hpc.config import config_hash, flatten
from hpc.config.schema import DSparkConfig
from hpc.config.secrets import redacted, scrub
from hpc.track.keys import (
    CONFIG_HASH,
    CONFIG_NAME,
    OUTCOME,
    PARENT_RUN_ID,
    RUN_NAME,
    SPEC_N,
    STAGE,
    STAGE_EVAL,
    STAGE_EVAL_ADAPTIVE,
    STAGE_PIPELINE,
    STAGE_TRAIN,
)


def git_sha() -> str:
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def slurm_tags() -> dict[str, str]:
    env = os.environ
    names = {"SLURM_JOB_ID": "slurm.job_id", "SLURM_ARRAY_JOB_ID": "slurm.array_job_id",
             "SLURM_ARRAY_TASK_ID": "slurm.array_task_id", "SLURM_JOB_NODELIST": "slurm.nodelist"}
    return {tag: env[var] for var, tag in names.items() if env.get(var)}


def common_tags(cfg: DSparkConfig) -> dict[str, str]:
    return {"git.sha": git_sha(), CONFIG_HASH: config_hash(OmegaConf.structured(cfg)),
            CONFIG_NAME: cfg.name, **slurm_tags()}


def experiment_id(client, name: str) -> str:
    """The experiment's id, created if new. On a sqlite:/// store MLflow would put the artifacts in
    ./mlruns of whatever directory the process runs in; they go next to the database instead."""
    exp = client.get_experiment_by_name(name)
    if exp:
        return exp.experiment_id
    location = None
    if client.tracking_uri.startswith("sqlite:///"):
        db = Path(client.tracking_uri.removeprefix("sqlite:///")).resolve()
        location = (db.parent / "mlartifacts").as_uri()
    return client.create_experiment(name, artifact_location=location)


def create_pipeline_run(client, cfg: DSparkConfig, run_name: str | None = None, tags: dict[str, str] | None = None) -> str:
    """The parent run: resolved config as params, the pipeline's tags (plus `tags`)."""
    from mlflow.entities import Param  # mlflow: loaded only on this path

    exp = experiment_id(client, cfg.tracking.experiment)
    run = client.create_run(exp, run_name=run_name or cfg.name,
                            tags={STAGE: STAGE_PIPELINE, **common_tags(cfg), **(tags or {})})

    params = [Param(k, str(v)[:6000]) for k, v in flatten(OmegaConf.structured(redacted(cfg))).items()]
    try:
        for i in range(0, len(params), 100):
            client.log_batch(run.info.run_id, params=params[i:i + 100])
    except BaseException as err:  # nothing will run under it: it must not read as still working
        end_pipeline_run(client, run.info.run_id, "FAILED",
                         f"its parameters could not be logged: {(str(err).splitlines() or [''])[0][:200]}")
        raise
    return run.info.run_id


def create_child_run(client, experiment: str, parent_run_id: str | None, name: str, tags: dict[str, str]) -> str:
    all_tags = {RUN_NAME: name, **tags}
    if parent_run_id:
        all_tags[PARENT_RUN_ID] = parent_run_id
    return client.create_run(experiment_id(client, experiment), run_name=name, tags=all_tags).info.run_id


def _children(client, parent) -> list:
    where = f"tags.`{PARENT_RUN_ID}` = '{parent.info.run_id}'"
    runs, token = [], None
    while True:
        page = client.search_runs([parent.info.experiment_id], where, max_results=1000, page_token=token)
        runs += list(page)
        token = page.token
        if not token:
            return runs


def pipeline_outcome(client, parent_run_id: str, ns: list[int], adaptive: bool = False) -> tuple[str, str]:
    """(FINISHED or FAILED, why) from the stages' runs. A run of a requeued (preempted) job ends
    KILLED and its successor carries on, so KILLED alone is no failure; but a stage run that
    FAILED or never ended (its job died with it), a training variant (config hash) that never
    finished, or an n at which some variant has no eval run (a failed eval leaves none) is."""
    runs = _children(client, client.get_run(parent_run_id))
    for r in runs:
        if r.info.status in ("FAILED", "RUNNING", "SCHEDULED"):
            what = "failed" if r.info.status == "FAILED" else "never ended (its job died)"
            return "FAILED", f"stage run {r.info.run_name} ({r.info.run_id}) {what}"
    finished: dict[str, bool] = {}
    for r in runs:
        if r.data.tags.get(STAGE) == STAGE_TRAIN:
            variant = r.data.tags.get(CONFIG_HASH, r.info.run_id)
            finished[variant] = finished.get(variant, False) or r.info.status == "FINISHED"
    if not all(finished.values()):
        return "FAILED", f"{sum(not f for f in finished.values())} training variant(s) never finished"
    for n in ns:
        evaluated = {r.data.tags.get(CONFIG_HASH) for r in runs
                     if r.data.tags.get(STAGE) == STAGE_EVAL and r.data.tags.get(SPEC_N) == str(n)}
        if len(evaluated) < max(len(finished), 1):
            return "FAILED", f"{max(len(finished), 1) - len(evaluated)} variant(s) have no eval run at n={n}"
    if adaptive:  # eval.adaptive chained a third evaluation: a variant without its run did not finish it
        done = {r.data.tags.get(CONFIG_HASH) for r in runs if r.data.tags.get(STAGE) == STAGE_EVAL_ADAPTIVE}
        # an ablation without a confidence head trains with eval.adaptive off: it owes no such run
        owed = len({r.data.tags.get(CONFIG_HASH, r.info.run_id) for r in runs if r.data.tags.get(STAGE) == STAGE_TRAIN
                    and r.data.params.get("eval.adaptive") != "False"}) if finished else 1
        if (missing := owed - len(done)) > 0:
            return "FAILED", f"{missing} variant(s) have no adaptive-verification eval run"
    return "FINISHED", "every stage succeeded"


def end_pipeline_run(client, parent_run_id: str, status: str, why: str) -> None:
    """Set the parent run's final status (and why, as a tag); a tracking outage is a warning, not
    a second error on top of the one being reported."""
    try:
        client.set_tag(parent_run_id, OUTCOME, scrub(why))  # error text quotes request URLs
        client.set_terminated(parent_run_id, status)
    except Exception as err:  # noqa: BLE001
        print(f"warning: pipeline run {parent_run_id} not marked {status}: {scrub(str(err).splitlines()[0])[:160]}",
              flush=True)


@contextmanager
def ends(client, run_id: str | None, what: str) -> Iterator[None]:
    """End `run_id`, a pipeline run the work inside owns, as that work ends: FINISHED, FAILED (with
    the error's first line), or KILLED on Ctrl-C. A run left RUNNING reads as still working."""
    if run_id is None:
        yield
        return
    try:
        yield
    except BaseException as err:
        why = scrub((str(err).splitlines() or [type(err).__name__])[0])[:200]
        end_pipeline_run(client, run_id, "KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED",
                         f"{what} failed: {why}")
        raise
    end_pipeline_run(client, run_id, "FINISHED", f"{what} finished")
