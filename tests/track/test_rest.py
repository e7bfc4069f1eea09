"""The watch tick's MLflow REST client against a real tracking server: what it reads is what
MlflowClient reads, what it writes MlflowClient reads back, and its errors say what to do."""

from __future__ import annotations

import socket
import uuid

import pytest
from mlflow.entities import Metric
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from hpc.errors import UserError
from hpc.track import rest
from hpc.track.rest import RestClient, RestError, not_found, tracking_client


def _experiment(client: MlflowClient) -> str:
    return client.create_experiment(f"rest-{uuid.uuid4().hex[:8]}")


def test_what_it_reads_is_what_mlflow_reads_page_after_page(mlflow_server, monkeypatch):
    monkeypatch.setattr(rest, "PAGE", 2)  # five runs and seven points: every listing takes several pages
    mc, rc = MlflowClient(mlflow_server.uri), RestClient(mlflow_server.uri)
    exp = _experiment(mc)
    ids = []
    for i in range(5):
        run = mc.create_run(exp, run_name=f"r{i}", tags={"kind": "even" if i % 2 == 0 else "odd", "i": str(i)})
        mc.log_param(run.info.run_id, "lr", 0.1 * i)
        mc.log_batch(run.info.run_id, metrics=[Metric("loss", 1.0 / (s + 1 + i), 1000 + s, s) for s in range(7)])
        if i == 3:
            mc.set_terminated(run.info.run_id, "FAILED")
        ids.append(run.info.run_id)

    for query in ("", "tags.kind = 'even'", "attributes.status = 'FAILED'"):
        want = mc.search_runs([exp], query, order_by=["attributes.start_time DESC"], max_results=4)
        got = rc.search_runs([exp], query, order_by=["attributes.start_time DESC"], max_results=4)
        assert [r.info.run_id for r in got] == [r.info.run_id for r in want], query
    for run_id in ids:
        want, got = mc.get_run(run_id), rc.get_run(run_id)
        assert (got.info.run_id, got.info.experiment_id, got.info.run_name, got.info.status, got.info.artifact_uri) == \
            (want.info.run_id, want.info.experiment_id, want.info.run_name, want.info.status, want.info.artifact_uri)
        assert (got.data.metrics, got.data.params) == (want.data.metrics, want.data.params)
        assert {k: v for k, v in got.data.tags.items()} == want.data.tags
        assert [(m.value, m.timestamp, m.step) for m in rc.get_metric_history(run_id, "loss")] == \
            [(m.value, m.timestamp, m.step) for m in mc.get_metric_history(run_id, "loss")]
    assert rc.get_experiment_by_name(mc.get_experiment(exp).name).experiment_id == exp


def test_what_it_writes_mlflow_reads_back(mlflow_server, tmp_path):
    mc, rc = MlflowClient(mlflow_server.uri), RestClient(mlflow_server.uri)
    exp = _experiment(mc)
    run = rc.create_run(exp, run_name="serving-v1", tags={"dspark.stage": "serving"})
    rid = run.info.run_id
    rc.log_param(rid, "n", 3)
    rc.log_batch(rid, metrics=[rest.Metric("serving/live_tau", 2.5, 5000, 1), rest.Metric("serving/drafts", 40.0, 5000, 1)])
    png = tmp_path / "live_tau.png"
    png.write_bytes(b"\x89PNG not really, but bytes")
    rc.log_artifact(rid, str(png), "serving")
    rc.set_terminated(rid, "KILLED")

    back = mc.get_run(rid)
    assert back.info.run_name == "serving-v1" and back.info.status == "KILLED" and back.info.end_time
    assert back.data.params == {"n": "3"} and back.data.tags["dspark.stage"] == "serving"
    assert back.data.metrics == {"serving/live_tau": 2.5, "serving/drafts": 40.0}
    assert [(m.step, m.timestamp) for m in mc.get_metric_history(rid, "serving/live_tau")] == [(1, 5000)]
    assert [f.path for f in mc.list_artifacts(rid, "serving")] == ["serving/live_tau.png"]
    local = mc.download_artifacts(rid, "serving/live_tau.png", str(tmp_path / "down"))
    assert open(local, "rb").read() == png.read_bytes()


def test_a_missing_model_or_alias_reads_as_not_found_from_either_client(mlflow_server):
    mc, rc = MlflowClient(mlflow_server.uri), RestClient(mlflow_server.uri)
    name = f"m-{uuid.uuid4().hex[:8]}"
    for client, error in ((rc, RestError), (mc, MlflowException)):
        with pytest.raises(error) as err:
            client.get_model_version_by_alias(name, "champion")  # no such model
        assert not_found(err.value)
    mc.create_registered_model(name)
    with pytest.raises(RestError) as err:
        rc.get_model_version_by_alias(name, "champion")  # the model, no champion
    assert not_found(err.value)
    assert rc.get_experiment_by_name(f"none-{uuid.uuid4().hex}") is None
    with pytest.raises(RestError) as err:
        rc.get_run("0" * 32)
    assert err.value.error_code == "RESOURCE_DOES_NOT_EXIST"


def test_an_unreachable_server_is_one_line_naming_the_key():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens once it closes
    uri = f"http://127.0.0.1:{port}"
    with pytest.raises(UserError, match=rf"tracking.uri = {uri}: the tracking server did not answer") as err:
        RestClient(uri, timeout_s=2).get_experiment_by_name("x")
    assert "\n" not in str(err.value)


def test_only_an_http_tracking_server_gets_the_rest_client(tmp_path):
    assert isinstance(tracking_client("http://127.0.0.1:5000"), RestClient)
    assert isinstance(tracking_client("https://mlflow.example.org/"), RestClient)
    assert isinstance(tracking_client(f"sqlite:///{tmp_path}/m.db"), MlflowClient)
