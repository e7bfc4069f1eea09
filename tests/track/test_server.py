"""The tracking server the pipeline logs to: runs round-trip params, metrics and artifacts."""

from __future__ import annotations

import re

import pytest
from mlflow.tracking import MlflowClient

from hpc.errors import UserError
from hpc.net import free_port
from hpc.track.server import MlflowServer, is_healthy
from tests.fixtures.sockets import listening_addresses


def test_run_round_trips_params_metrics_and_artifact(mlflow_server, tmp_path):
    # A client, not mlflow.set_tracking_uri: that sets MLFLOW_TRACKING_URI for every later test.
    client = MlflowClient(mlflow_server.uri)
    exp = client.get_experiment_by_name("roundtrip")
    run = client.create_run(exp.experiment_id if exp else client.create_experiment("roundtrip"), run_name="probe")
    note = tmp_path / "results.json"
    note.write_text('{"accept_len": 3.14}')
    client.log_param(run.info.run_id, "train.lr", 3e-4)
    client.log_param(run.info.run_id, "draft.block_size", 8)
    for step, loss in enumerate([2.0, 1.5, 1.25]):
        client.log_metric(run.info.run_id, "loss", loss, step=step)
    client.log_artifact(run.info.run_id, str(note))
    client.set_terminated(run.info.run_id)
    got = client.get_run(run.info.run_id)
    assert got.data.params == {"train.lr": "0.0003", "draft.block_size": "8"}
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(0, 2.0), (1, 1.5), (2, 1.25)]
    local = client.download_artifacts(run.info.run_id, "results.json", str(tmp_path / "dl"))
    assert open(local).read() == note.read_text()


def test_server_binds_loopback_only(mlflow_server):
    assert mlflow_server.host == "127.0.0.1" and is_healthy(mlflow_server.uri)
    assert listening_addresses(mlflow_server.port) == {"127.0.0.1"}  # the socket, not the attribute


def test_unreachable_server_is_reported(tmp_path):
    assert not is_healthy(f"http://127.0.0.1:{free_port()}", timeout=0.5)


def test_server_that_cannot_start_names_the_cause(tmp_path, mlflow_server):
    # The port is taken by the session server: the second one must fail with its log tail.
    clash = MlflowServer(tmp_path / "clash", port=mlflow_server.port)
    with pytest.raises(UserError, match="mlflow server"):
        clash.start(timeout_s=30)


@pytest.mark.parametrize("host, needle", [("10.255.255.1", "--host 10.255.255.1 is not an address of this machine"),
                                          ("no.such.host.invalid", "--host 'no.such.host.invalid' does not resolve")])
def test_a_host_that_is_not_this_machines_is_one_line_naming_the_flag(tmp_path, host, needle):
    # It said the (free) port was in use, or raised from the socket layer.
    with pytest.raises(UserError, match=re.escape(needle)):
        MlflowServer(tmp_path / "m", host=host, port=5999).start()


def test_the_server_leaves_no_job_store_in_dev_shm(mlflow_server):
    """MLflow's job runner keeps its store in a /dev/shm temp dir that it never removes, one per
    server start: node RAM that the next job needs. Ours runs without it."""
    from pathlib import Path

    import psutil

    started = psutil.Process(mlflow_server.proc.pid).create_time()
    stores = [p for p in Path("/dev/shm").glob("*/*.mlflow-huey-store*") if p.stat().st_mtime >= started - 1]
    assert stores == []
