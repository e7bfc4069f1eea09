"""The tracking server the pipeline logs to: runs round-trip params, metrics and artifacts."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient

from hpc.errors import UserError
from hpc.net import free_port
from hpc.track.server import MlflowServer, is_healthy
from hpc_dev.devcluster_net import LOGIN_NAME
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


def _from_node(node: str, code: str) -> subprocess.CompletedProcess[str]:
    """Python run on a dev cluster node: in its network namespace, with its own address and loopback."""
    from hpc_dev.devcluster_net import NETNS_DIR, PREFIX

    return subprocess.run(["nsenter", f"--net={NETNS_DIR}/{PREFIX}{node}", "--", sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=60)


def test_the_session_server_serves_the_nodes_on_the_login_address_only(mlflow_server, cluster_network):
    """The nodes log to the login node by its name and address; its loopback is no node's."""
    assert mlflow_server.host == cluster_network and not cluster_network.startswith("127.")
    assert listening_addresses(mlflow_server.port) == {cluster_network}  # the socket, not the attribute
    probe = ("import sys, urllib.request, urllib.error\n"
             "for url in sys.argv[1:]:\n"
             "    try:\n"
             "        print(url, urllib.request.urlopen(url, timeout=5).status)\n"
             "    except urllib.error.HTTPError as e:\n"
             "        print(url, e.code)\n"
             "    except OSError as e:\n"
             "        print(url, 'refused')\n")
    api = "/api/2.0/mlflow/experiments/search?max_results=1"
    urls = [f"http://{h}:{mlflow_server.port}{api}" for h in (cluster_network, LOGIN_NAME, "127.0.0.1")]
    res = _from_node("node2", probe.replace("sys.argv[1:]", repr(urls)))
    assert res.returncode == 0, res.stderr
    answers = dict(line.rsplit(" ", 1) for line in res.stdout.splitlines())
    assert answers == {urls[0]: "200", urls[1]: "200", urls[2]: "refused"}, res.stdout


@pytest.mark.slow  # starts real MLflow servers
def test_a_host_name_the_server_does_not_serve_is_one_tracking_uri_line(tmp_path):
    """MLflow's Host check answered 403 to every job of a server on a login node's address, and
    validate (which asked /health, exempt from the check) said the config was valid."""
    from hpc.config.validate_ops import _tracking_problem

    with MlflowServer(tmp_path / "m", host="127.0.0.2") as server:  # the issue's own: not MLflow's default list
        assert _tracking_problem(server.uri, "probe") is None
        MlflowClient(server.uri).search_experiments()  # a real client, through the API
        aliased = f"http://127.2:{server.port}"  # the same socket, dialled by a name it was not told
        assert is_healthy(aliased)
        why = _tracking_problem(aliased, "probe")
        assert why is not None and "refuses the host name '127.2'" in why and "--allow-host 127.2" in why
    with MlflowServer(tmp_path / "n", host="127.0.0.2", extra_hosts=("127.2",)) as server:
        assert _tracking_problem(f"http://127.2:{server.port}", "probe") is None


@pytest.mark.slow  # starts real MLflow servers
def test_every_interface_needs_asking_and_still_prints_a_real_address(tmp_path):
    for host in ("0.0.0.0", "::"):
        with pytest.raises(UserError, match=re.escape(f"--host {host} listens on every interface") + ".*--all-interfaces"):
            MlflowServer(tmp_path / "w", host=host).start()
    assert not (tmp_path / "w").exists()  # refused before anything is made
    with MlflowServer(tmp_path / "w", host="0.0.0.0", all_interfaces=True) as server:
        assert "0.0.0.0" not in server.uri and not server.served[0].startswith("127.")
        assert listening_addresses(server.port) == {"0.0.0.0"}
        for addr in [a for a in server.served if ":" not in a]:
            MlflowClient(f"http://{addr}:{server.port}").search_experiments()  # every address is served


def test_unreachable_server_is_reported(tmp_path):
    assert not is_healthy(f"http://127.0.0.1:{free_port()}", timeout=0.5)


def test_server_that_cannot_start_names_the_cause(tmp_path, mlflow_server):
    # The port is taken by the session server: the second one must fail with its log tail.
    clash = MlflowServer(tmp_path / "clash", host=mlflow_server.host, port=mlflow_server.port)
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
