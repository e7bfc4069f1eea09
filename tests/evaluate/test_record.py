"""A run directory becomes one MLflow run, whole: re-measured results get a new one, a dropped
benchmark's leftover file is not counted, and a half-logged run is removed for the retry."""

from __future__ import annotations

import json
from dataclasses import asdict
from types import SimpleNamespace

import pytest

from hpc.evaluate.harness import BenchResult, write_json_atomic
from hpc.evaluate.record import load_results, pending_runs, upload_run
from hpc.evaluate.runner import Job, _write_meta

TRACKING = SimpleNamespace(experiment="e", registered_model="m")


def result(bench: str, sha: str = "a" * 64, accept_len: float = 2.0) -> BenchResult:
    return BenchResult(benchmark=bench, rows=2, sha256=sha, source="fixture", engine="reference", label="baseline",
                       method="none", n=0, tok_s=10.0, output_tokens=20, wall_s=2.0, max_tokens=16,
                       accept_len=accept_len)


def measure(run_dir, results: list[BenchResult]) -> None:
    for r in results:
        write_json_atomic(run_dir / f"{r.benchmark}.json", asdict(r))
    _write_meta(run_dir, TRACKING, Job(None, 0, "reference"), "baseline", "parent", {}, results)


def test_re_measured_results_are_a_new_run_and_dropped_benchmarks_do_not_count(tmp_path, capsys):
    run_dir = tmp_path / "baseline-reference"
    run_dir.mkdir()
    measure(run_dir, [result("gsm8k"), result("aime")])
    meta = json.loads((run_dir / "run.json").read_text())
    write_json_atomic(run_dir / "run.json", {**meta, "mlflow_run_id": "r1"})  # uploaded
    assert pending_runs(tmp_path) == []

    measure(run_dir, [result("gsm8k"), result("aime")])  # a requeue: nothing re-measured
    assert pending_runs(tmp_path) == [] and "re-measured" not in capsys.readouterr().out

    # The next evaluation drops aime and reads other gsm8k rows: a new run, without aime.
    measure(run_dir, [result("gsm8k", sha="b" * 64)])
    assert pending_runs(tmp_path) == [run_dir]
    assert "re-measured, so it is logged as a new MLflow run (the last was r1)" in capsys.readouterr().out
    assert (run_dir / "aime.json").is_file()  # left on disk...
    assert [(r.benchmark, r.sha256) for r in load_results(run_dir)] == [("gsm8k", "b" * 64)]  # ...not counted


def test_a_directory_measured_before_the_count_rename_keeps_its_mlflow_run(tmp_path, capsys):
    """Its run.json digest was taken over the old key names: a requeue after the upgrade must not
    read the renamed fields as a re-measurement and log the run twice."""
    import hashlib

    from tests.evaluate.test_harness import OLD_FILE

    run_dir = tmp_path / "eval-n3-ngram"
    run_dir.mkdir()
    (run_dir / "gsm8k.json").write_text(json.dumps(OLD_FILE))
    old_digest = hashlib.sha256(json.dumps([OLD_FILE], sort_keys=True).encode()).hexdigest()  # as the old code took it
    write_json_atomic(run_dir / "run.json", {"digest": old_digest, "mlflow_run_id": "r1"})
    _write_meta(run_dir, TRACKING, Job(None, 3, "vllm"), "eval", "parent", {}, load_results(run_dir, ["gsm8k"]))
    assert json.loads((run_dir / "run.json").read_text())["mlflow_run_id"] == "r1"
    assert "re-measured" not in capsys.readouterr().out and pending_runs(tmp_path) == []


class BrokenClient:
    """MLflow answering the run's creation, then failing mid-upload (a server restart, a full disk)."""

    def __init__(self):
        self.deleted: list[str] = []

    def create_run(self, *_a, **_k):
        return SimpleNamespace(info=SimpleNamespace(run_id="half"))

    def get_experiment_by_name(self, _name):
        return SimpleNamespace(experiment_id="0")

    def log_batch(self, *_a, **_k):
        raise ConnectionError("tracking server went away")

    def delete_run(self, run_id):
        self.deleted.append(run_id)


def test_a_half_logged_run_is_deleted_and_the_directory_stays_pending(tmp_path):
    run_dir = tmp_path / "baseline-reference"
    run_dir.mkdir()
    measure(run_dir, [result("gsm8k")])
    client = BrokenClient()
    with pytest.raises(ConnectionError):
        upload_run(client, run_dir)
    assert client.deleted == ["half"]  # not left RUNNING for the pipeline's outcome to read as failed
    assert pending_runs(tmp_path) == [run_dir]  # `dspark evaluate --upload` sends it whole later


def test_results_evaluated_while_tracking_was_down_get_one_pipeline_run_that_ends(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from hpc.config import load_config, to_object
    from hpc.evaluate import record

    uri = f"sqlite:///{tmp_path}/m.db"
    cfg = to_object(load_config("configs/toy-cpu.yaml", [f"tracking.uri={uri}", "tracking.experiment=offline"]))
    client = MlflowClient(uri)
    out = tmp_path / "eval"
    for name in ("baseline-reference", "baseline-vllm"):
        (out / name).mkdir(parents=True)
        for r in [result("gsm8k")]:
            write_json_atomic(out / name / "gsm8k.json", asdict(r))
        _write_meta(out / name, cfg.tracking, Job(None, 0, "reference"), "baseline", None, {}, [result("gsm8k")])

    def parents():
        exp = client.get_experiment_by_name("offline").experiment_id
        return client.search_runs([exp], "tags.`dspark.stage` = 'pipeline'", order_by=["attributes.start_time ASC"])

    real = record.upload_run
    monkeypatch.setattr(record, "upload_run", lambda *_a, **_k: (_ for _ in ()).throw(ConnectionError("server went away")))
    with pytest.raises(ConnectionError):
        record.upload_all(client, out, cfg, quiet=True)
    [failed] = parents()  # not left RUNNING
    assert failed.info.status == "FAILED" and failed.data.tags["dspark.outcome"] == "upload failed: server went away"

    monkeypatch.setattr(record, "upload_run", real)
    ids = record.upload_all(client, out, cfg, quiet=True)
    assert len(ids) == 2
    failed, retry = parents()
    assert [failed.info.status, retry.info.status] == ["FAILED", "FINISHED"]  # the first attempt's, then the retry's
    # The runs hang under the retry's pipeline run, not the one that failed with the first attempt.
    assert {client.get_run(i).data.tags["mlflow.parentRunId"] for i in ids} == {retry.info.run_id}


def test_a_registration_that_failed_after_the_upload_is_retried_once(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from hpc.config import load_config, to_object
    from hpc.evaluate import record
    from hpc.evaluate.drafts import DraftSpec
    from hpc.track import registry

    uri = f"sqlite:///{tmp_path}/m.db"
    cfg = to_object(load_config("configs/toy-cpu.yaml", [f"tracking.uri={uri}", "tracking.experiment=reg"]))
    client = MlflowClient(uri)
    run_dir = tmp_path / "eval" / "eval-n7-DSpark"
    run_dir.mkdir(parents=True)
    r = BenchResult(**{**asdict(result("gsm8k", accept_len=3.0)), "n": 7, "label": "DSpark", "method": "dspark"})
    write_json_atomic(run_dir / "gsm8k.json", asdict(r))
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    _write_meta(run_dir, cfg.tracking, Job(DraftSpec("DSpark", "dspark", str(draft), True, 8), 7, "reference"),
                "eval", None, {}, [r], [(str(draft), "draft")])

    real = registry.register_draft
    calls = []

    def register_then_fail(*a, **k):  # the version is made, then the server goes away
        calls.append(real(*a, **k))
        raise ConnectionError("tracking server restarted")

    monkeypatch.setattr(record, "register_draft", register_then_fail)
    with pytest.raises(ConnectionError):
        record.upload_all(client, tmp_path / "eval", cfg, quiet=True)
    assert record.pending_runs(tmp_path / "eval", cfg) == [run_dir]  # uploaded, but not yet registered
    monkeypatch.setattr(record, "register_draft", real)
    assert record.upload_all(client, tmp_path / "eval", cfg, quiet=True) == []  # nothing uploaded twice
    versions = client.search_model_versions(f"name = '{cfg.tracking.registered_model}'")
    assert [str(v.version) for v in versions] == calls == ["1"]  # the version made before the failure, once
    assert str(client.get_model_version_by_alias(cfg.tracking.registered_model, "champion").version) == "1"
    assert record.pending_runs(tmp_path / "eval", cfg) == []
