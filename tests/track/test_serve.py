"""`dspark tracking serve`: the authenticated MLflow server a pipeline's jobs log to; and
`dspark submit` refusing a file store that concurrent jobs would corrupt."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from hpc.errors import UserError
from hpc.track.rest import RestClient
from hpc_dev.toy_data import write_toy_conversations

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def served(tmp_path):
    root = tmp_path / "tracking"
    proc = subprocess.Popen([sys.executable, "-m", "hpc", "tracking", "serve", "--root", str(root)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    uri, deadline = None, time.monotonic() + 120
    while uri is None and time.monotonic() < deadline and proc.poll() is None:
        line = proc.stdout.readline()
        m = re.search(r"tracking server: (http://\S+)", line)
        uri = m and m.group(1)
    assert uri, f"no server ({proc.poll()})"
    creds = dict(re.findall(r"export (\w+)=(\S+)", (root / "credentials.env").read_text()))
    yield uri, creds, root
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(60)


def test_a_pipeline_logs_through_the_authenticated_server(served, toy_target, tmp_path, monkeypatch):
    uri, creds, root = served
    assert (root / "credentials.env").stat().st_mode & 0o777 == 0o600
    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    with pytest.raises(Exception, match="401|403|nauthori|ermission"):
        MlflowClient(uri).search_experiments()  # anyone else on the network: refused
    with pytest.raises(UserError, match="answered 401; set MLFLOW_TRACKING_USERNAME"):
        RestClient(uri).get_experiment_by_name("served")  # the watch tick's client says what to set

    data = write_toy_conversations(tmp_path / "train.jsonl", n=24, seed=1)
    res = subprocess.run([sys.executable, "-m", "hpc", "train", "configs/toy-cpu.yaml", f"verifier.model={toy_target}",
                          "verifier.backend=hf", f"data.sources=[{{path: {data}}}]", f"train.output_dir={tmp_path / 'run'}",
                          "train.warmup_steps=1", "train.checkpoint_interval=2", f"tracking.uri={uri}",
                          "tracking.experiment=served", "--steps", "4"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, **creds})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    for key, value in creds.items():
        monkeypatch.setenv(key, value)
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("served").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["train.steps"] == "4"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 3, 4]
    (light,) = RestClient(uri).search_runs([run.info.experiment_id])  # the credentials from the environment
    assert light.info.run_id == run.info.run_id and light.data.params["train.steps"] == "4"


def test_submit_refuses_a_file_store_before_anything_happens(toy_target, tmp_path):
    res = subprocess.run([sys.executable, "-m", "hpc", "submit", "configs/toy-cpu.yaml", f"verifier.model={toy_target}",
                          "data.sources=[{path: toy/chat}]", f"cluster.log_dir={tmp_path / 'slurm'}",
                          f"tracking.uri=sqlite:///{tmp_path}/m.db"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 2 and "dspark tracking serve" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and not (tmp_path / "slurm").exists()


def test_credentials_are_drawn_once_whole_and_a_broken_file_is_named(tmp_path):
    from hpc.track.serve_cli import CREDENTIALS, credentials

    root = tmp_path / "store"
    first = credentials(root)
    assert credentials(root) == first and len(first) >= 24  # drawn once, then read back
    path = root / CREDENTIALS
    assert path.stat().st_mode & 0o777 == 0o600 and os.stat(root).st_mode & 0o777 == 0o700
    assert [p.name for p in root.iterdir()] == [CREDENTIALS]  # no temp file left beside it
    path.write_text("")  # e.g. cut short by an older version
    with pytest.raises(UserError, match=r"has no `export MLFLOW_TRACKING_PASSWORD=` line; delete it and .*basic_auth"):
        credentials(root)
    # MLflow keeps an existing admin's password: with the users left, a new one would lock jobs out.
    path.unlink()
    (root / "basic_auth.db").write_bytes(b"")
    with pytest.raises(UserError, match=r"is gone but .*basic_auth.db still holds the admin password"):
        credentials(root)
    assert not path.exists()


@pytest.mark.slow  # starts real MLflow servers
def test_the_server_owns_its_root_and_trusts_nothing_planted_in_it(tmp_path):
    """With --root already there at 0777: a credentials.env of another uid let the planter's password
    in, auth.ini was written through a planted link, server.log appended through another, and the
    store stayed 0777 with mlflow.db 0644."""
    from hpc.track.serve_cli import CREDENTIALS, credentials
    from hpc.track.server import MlflowServer

    open_root = tmp_path / "open"
    open_root.mkdir()
    open_root.chmod(0o777)
    with pytest.raises(UserError, match=r"may be written by others \(mode 777\).*--root a directory of your own"):
        credentials(open_root)
    with pytest.raises(UserError, match=r"may be written by others \(mode 777\).*--root a directory of your own"):
        MlflowServer(open_root).start()
    assert list(open_root.iterdir()) == []  # refused before anything was written
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    os.chown(foreign, 65534, 65534)
    with pytest.raises(UserError, match="belongs to uid 65534"):
        credentials(foreign)

    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    planted = root / CREDENTIALS
    planted.write_text("export MLFLOW_TRACKING_USERNAME=dspark\nexport MLFLOW_TRACKING_PASSWORD=planted\n")
    os.chown(planted, 65534, 65534)
    with pytest.raises(UserError, match=r"not a credentials file this command wrote .*belongs to uid 65534"):
        credentials(root)
    os.chown(planted, os.getuid(), os.getgid())
    planted.chmod(0o644)
    with pytest.raises(UserError, match=r"may be read by others \(mode 644\)"):
        credentials(root)
    planted.unlink()

    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    (root / "auth.ini").symlink_to(victim)
    password = credentials(root)
    server = MlflowServer(root, auth_password=password)
    with server:
        assert (root / "auth.ini").is_file() and not (root / "auth.ini").is_symlink()  # replaced, not followed
        modes = {p.name: p.stat().st_mode & 0o777 for p in root.iterdir()}
        assert oct(root.stat().st_mode & 0o777) == "0o700"
        assert modes["mlflow.db"] == modes["basic_auth.db"] == modes["auth.ini"] == 0o600, modes
        assert modes["artifacts"] == 0o700 and modes["server.log"] == 0o600, modes
    assert victim.read_text() == "keep\n"
    log = root / "server.log"
    log.unlink()
    log.symlink_to(victim)
    with pytest.raises(UserError, match=r"server.log is a symbolic link; a server log is never written through one"):
        MlflowServer(root, auth_password=password).start()
    assert victim.read_text() == "keep\n"
