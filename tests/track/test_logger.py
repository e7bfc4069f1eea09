"""Training-side MLflow logging survives a tracking-server outage without blocking."""

from __future__ import annotations

import threading

import pytest
from mlflow.tracking import MlflowClient

from hpc.track.logger import RunLogger
from hpc.track.server import MlflowServer
from tests.fixtures.wait import wait_until


@pytest.mark.slow
def test_metrics_are_buffered_while_the_server_is_down(tmp_path):
    server = MlflowServer(tmp_path / "mlflow").start()  # its own: the test stops and restarts it
    try:
        log = RunLogger(server.uri, "outage", "train", flush_every_s=0.2, system_every_s=None)
        log.log_params({"train.lr": 3e-4})
        for step in range(5):
            log.log_metrics({"loss": 5.0 - step}, step)
        wait_until(lambda: log.buffered == 0 and log.run_id is not None, 60, what="first metrics sent")
        server.stop()

        # Training never waits on the dead server: only the sender thread calls it.
        callers = []
        send = log.client.log_batch
        log.client.log_batch = lambda *a, **k: callers.append(threading.current_thread()) or send(*a, **k)
        for step in range(5, 20):
            log.log_metrics({"loss": 5.0 - step}, step)
        wait_until(lambda: log.last_error is not None, 30, what="the outage noticed")
        assert log.buffered == 15
        assert callers and threading.current_thread() not in callers

        server.start()
        wait_until(lambda: log.buffered == 0, 90, what=lambda: f"buffer drained (last error: {log.last_error})")
        assert log.close()
        history = MlflowClient(server.uri).get_metric_history(log.run_id, "loss")
        assert sorted(m.step for m in history) == list(range(20))
        assert MlflowClient(server.uri).get_run(log.run_id).data.params == {"train.lr": "0.0003"}
    finally:
        server.stop()


@pytest.mark.slow
def test_run_created_late_when_the_server_starts_after_training(tmp_path):
    server = MlflowServer(tmp_path / "late")  # its own: it starts only after training began
    from hpc.net import free_port

    server.port = free_port()
    log = RunLogger(server.uri, "late", "train", flush_every_s=0.2, system_every_s=None)
    log.log_metrics({"loss": 1.0}, 0)
    wait_until(lambda: log.last_error is not None, 30, what="the missing server noticed")
    assert log.run_id is None
    server.start()
    try:
        wait_until(lambda: log.buffered == 0, 90, what="buffer drained")
        assert log.close() and log.run_id is not None
    finally:
        server.stop()
