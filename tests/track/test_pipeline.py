"""Pipeline runs on a local sqlite store: the artifacts stay next to the database, and the
parent run ends FINISHED or FAILED as its stages did."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from hpc.track.pipeline import STAGE, create_child_run, experiment_id, pipeline_outcome


def test_sqlite_artifacts_go_next_to_the_database_not_into_the_cwd(tmp_path, monkeypatch):
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    (tmp_path / "db").mkdir()
    client = MlflowClient(f"sqlite:///{tmp_path / 'db' / 'mlflow.db'}")
    exp = experiment_id(client, "local")
    assert experiment_id(client, "local") == exp  # found, not created twice
    run = create_child_run(client, "local", None, "stage", {})
    src = tmp_path / "note.txt"
    src.write_text("hi")
    client.log_artifact(run, str(src))
    assert (tmp_path / "db" / "mlartifacts").is_dir() and list((tmp_path / "db" / "mlartifacts").rglob("note.txt"))
    assert not (cwd / "mlruns").exists()
    assert Path(client.get_run(run).info.artifact_uri.removeprefix("file://")).is_relative_to(tmp_path / "db")


def _stage_run(client, parent, stage: str, status: str, variant: str = "v0", n: int | None = None) -> None:
    tags = {STAGE: stage, "dspark.config_hash": variant, **({"dspark.n": str(n)} if n else {})}
    run = create_child_run(client, "pipe", parent, f"{stage}-{variant}", tags)
    if status != "RUNNING":
        client.set_terminated(run, status)


OUTCOMES = {
    "all finished": ([("train", "FINISHED", "v0", None), ("eval", "FINISHED", "v0", 3), ("eval", "FINISHED", "v0", 7)],
                     "FINISHED", "every stage succeeded"),
    "preempted, then resumed": ([("train", "KILLED", "v0", None), ("train", "FINISHED", "v0", None),
                                 ("eval", "FINISHED", "v0", 3), ("eval", "FINISHED", "v0", 7)], "FINISHED", "every stage"),
    "a train run failed": ([("train", "FAILED", "v0", None)], "FAILED", "failed"),
    "a train job died": ([("train", "RUNNING", "v0", None)], "FAILED", "never ended"),
    "a variant never resumed": ([("train", "FINISHED", "v0", None), ("train", "KILLED", "v1", None),
                                 ("eval", "FINISHED", "v0", 3), ("eval", "FINISHED", "v0", 7)], "FAILED", "never finished"),
    "an eval left no run": ([("train", "FINISHED", "v0", None), ("train", "FINISHED", "v1", None),
                             ("eval", "FINISHED", "v0", 3), ("eval", "FINISHED", "v1", 3), ("eval", "FINISHED", "v0", 7)],
                            "FAILED", "1 variant(s) have no eval run at n=7"),
}


@pytest.mark.parametrize("runs,status,why", list(OUTCOMES.values()), ids=list(OUTCOMES))
def test_the_pipeline_outcome_follows_its_stages(tmp_path, runs, status, why):
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    parent = create_child_run(client, "pipe", None, "pipeline", {STAGE: "pipeline"})
    for stage, st, variant, n in runs:
        _stage_run(client, parent, stage, st, variant, n)
    got, said = pipeline_outcome(client, parent, [3, 7])
    assert got == status and why in said, said


def test_the_report_ends_the_pipeline_run_even_when_it_fails(tmp_path):
    from hpc.config.schema import DSparkConfig
    from hpc.errors import UserError
    from hpc.launch.stages import report_stage

    cfg = DSparkConfig()
    cfg.tracking.uri, cfg.tracking.experiment = f"sqlite:///{tmp_path / 'mlflow.db'}", "pipe"
    client = MlflowClient(cfg.tracking.uri)
    parent = create_child_run(client, "pipe", None, "pipeline", {STAGE: "pipeline"})
    _stage_run(client, parent, "train", "FAILED")
    with pytest.raises(UserError, match="no eval runs"):
        report_stage(cfg, parent)  # the evals never ran: nothing to report
    run = client.get_run(parent)
    assert run.info.status == "FAILED" and "no eval runs" in run.data.tags["dspark.outcome"]


def test_a_parent_run_whose_params_fail_is_ended_not_left_running(tmp_path):
    """submit drops its pipeline directory when the parent run cannot be made; a run already
    created stayed RUNNING, an orphan that read as a pipeline still working."""
    from mlflow.tracking import MlflowClient

    from hpc.config import load_config, to_object
    from hpc.track.pipeline import create_pipeline_run

    client = MlflowClient(f"sqlite:///{tmp_path / 'm.db'}")
    real = client.log_batch

    def outage(*a, **k):
        raise ConnectionError("API request to http://u:PW17@h/ failed")

    client.log_batch = outage
    kimi = Path(__file__).resolve().parents[2] / "configs" / "kimi-k2.6-dspark.yaml"
    cfg = to_object(load_config(str(kimi), [f"tracking.uri=sqlite:///{tmp_path / 'm.db'}"]))
    with pytest.raises(ConnectionError):
        create_pipeline_run(client, cfg, "p")
    client.log_batch = real
    (run,) = client.search_runs([client.get_experiment_by_name(cfg.tracking.experiment).experiment_id])
    assert run.info.status == "FAILED" and "PW17" not in str(run.data.tags)


def test_an_adaptive_pipeline_fails_without_its_adaptive_run(tmp_path):
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    parent = create_child_run(client, "pipe", None, "pipeline", {STAGE: "pipeline"})
    for stage, st, variant, n in OUTCOMES["all finished"][0]:
        _stage_run(client, parent, stage, st, variant, n)
    assert pipeline_outcome(client, parent, [3, 7])[0] == "FINISHED"
    got, why = pipeline_outcome(client, parent, [3, 7], adaptive=True)
    assert got == "FAILED" and "no adaptive-verification eval run" in why
    _stage_run(client, parent, "eval_adaptive", "FINISHED")
    assert pipeline_outcome(client, parent, [3, 7], adaptive=True) == ("FINISHED", "every stage succeeded")


def test_an_ablation_without_a_confidence_head_owes_no_adaptive_run(tmp_path):
    """submit.ablations with eval.adaptive: DSpark's variant chains adaptive verification; DFlash's and
    Markov-only's train with eval.adaptive off (no head to rank by), so only DSpark's run is owed."""
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    parent = create_child_run(client, "pipe", None, "pipeline", {STAGE: "pipeline"})
    for variant, adaptive in (("dspark", "True"), ("dflash", "False"), ("markov", "False")):
        run = create_child_run(client, "pipe", parent, f"train-{variant}", {STAGE: "train", "dspark.config_hash": variant})
        client.log_param(run, "eval.adaptive", adaptive)
        client.set_terminated(run, "FINISHED")
        for n in (3, 7):
            _stage_run(client, parent, "eval", "FINISHED", variant, n)
    assert pipeline_outcome(client, parent, [3, 7], adaptive=True) == (
        "FAILED", "1 variant(s) have no adaptive-verification eval run")
    _stage_run(client, parent, "eval_adaptive", "FINISHED", "dspark")
    assert pipeline_outcome(client, parent, [3, 7], adaptive=True) == ("FINISHED", "every stage succeeded")
