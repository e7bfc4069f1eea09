"""One MLflow parent run per pipeline, child runs per stage, and the tags every run carries.

The parent is created on the login node at submit time; stages running in other processes
or Slurm jobs attach to it by id (`mlflow.parentRunId`).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

STAGE = "dspark.stage"


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


def common_tags(cfg) -> dict[str, str]:
    from omegaconf import OmegaConf

    from hpc.config import config_hash

    return {"git.sha": git_sha(), "dspark.config_hash": config_hash(OmegaConf.structured(cfg)),
            "dspark.config_name": cfg.name, **slurm_tags()}


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


def create_pipeline_run(client, cfg, run_name: str | None = None, tags: dict[str, str] | None = None) -> str:
    """The parent run: resolved config as params, the pipeline's tags (plus `tags`)."""
    from mlflow.entities import Param

    from hpc.config import flatten

    from omegaconf import OmegaConf

    exp = experiment_id(client, cfg.tracking.experiment)
    run = client.create_run(exp, run_name=run_name or cfg.name, tags={STAGE: "pipeline", **common_tags(cfg), **(tags or {})})
    from hpc.config.secrets import redacted

    params = [Param(k, str(v)[:6000]) for k, v in flatten(OmegaConf.structured(redacted(cfg))).items()]
    for i in range(0, len(params), 100):
        client.log_batch(run.info.run_id, params=params[i:i + 100])
    return run.info.run_id


def create_child_run(client, experiment: str, parent_run_id: str | None, name: str, tags: dict[str, str]) -> str:
    all_tags = {"mlflow.runName": name, **tags}
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = parent_run_id
    return client.create_run(experiment_id(client, experiment), run_name=name, tags=all_tags).info.run_id
