"""Pipeline runs on a local sqlite store: the artifacts stay next to the database."""

from __future__ import annotations

from pathlib import Path

from mlflow.tracking import MlflowClient

from hpc.track.pipeline import create_child_run, experiment_id


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
