"""`dspark watch` and a drift schedule's tick against a real MLflow server: the champion's
evaluated figures at the served n, the serving run, the retrain a drift fires (once, then the
cooldown), the evidence on its parent run, and a token that reaches no run, line or file.
The endpoints are stdlib servers the test moves (hpc/watch/local_endpoints.py); vLLM's own
counters drive tests/watch/test_watch_vllm.py."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from hpc.errors import UserError
from hpc.launch import retrain
from hpc.launch.schedule import last_tick
from hpc.track.keys import DRAFT_SHA256, PARENT_RUN_ID, SPEC_N, STAGE, STAGE_EVAL, STAGE_PIPELINE, TEMPERATURE
from hpc.watch.local_endpoints import MetricsServer
from tests.launch.test_schedule import CONFIG, fake_submit, toy_overrides

TOKEN = "watch-secret-9f8e7d6c5b4a"  # noqa: S105 - a test token, looked for everywhere it must not be
HOUR = 3600.0


def evaluated_champion(uri: str, experiment: str, model: str, taus: dict[int, float]) -> str:
    """A pipeline with greedy eval runs of one draft at each n, registered at the largest n."""
    from mlflow.tracking import MlflowClient

    from hpc.track.registry import promote_if_better, register_draft

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment) or client.get_experiment(client.create_experiment(experiment))
    parent = client.create_run(exp.experiment_id, run_name="pipeline", tags={STAGE: STAGE_PIPELINE}).info.run_id
    runs = {}
    for n, tau in taus.items():
        run = client.create_run(exp.experiment_id, run_name=f"eval-n{n}-DSpark", tags={
            STAGE: STAGE_EVAL, SPEC_N: str(n), DRAFT_SHA256: "d" * 64, TEMPERATURE: "0", PARENT_RUN_ID: parent})
        client.log_metric(run.info.run_id, "mean/accept_len", tau)
        for i in range(1, n + 1):
            client.log_metric(run.info.run_id, f"gsm8k/accept_pos_{i}", max(0.0, min(1.0, tau - i)))
        client.set_terminated(run.info.run_id)
        runs[n] = run.info.run_id
    n = max(taus)
    version = register_draft(client, model, runs[n], "draft", taus[n], {"gsm8k": "a" * 64}, n=n)
    promote_if_better(client, model, version)
    return parent


@pytest.fixture
def endpoints():
    made = [MetricsServer(token=TOKEN), MetricsServer(token=TOKEN)]
    yield made
    for s in made:
        s.close()


def watch_overrides(tmp: Path, uri: str, name: str, servers, *extra: str) -> list[str]:
    urls = ", ".join(s.url for s in servers)
    return [*toy_overrides(tmp, uri, name), f"serve.endpoints=[{urls}]", "serve.token_env=DSPARK_TEST_SERVE_TOKEN",
            "serve.allow_http=true", "serve.num_speculative_tokens=3", "serve.window=2", "serve.min_drafts=100",
            "serve.cooldown=1:00:00", f"serve.state_dir={tmp / 'watch'}", "schedule.trigger=drift", *extra]


def test_drift_fires_one_warm_started_retrain_with_its_evidence_and_the_token_goes_nowhere(
        mlflow_server, endpoints, tmp_path, monkeypatch, capsys):
    from mlflow.tracking import MlflowClient

    from hpc.launch.launch_checks import resolve

    monkeypatch.setenv("DSPARK_TEST_SERVE_TOKEN", TOKEN)
    calls = fake_submit(monkeypatch)
    name = f"watch-{uuid.uuid4().hex[:8]}"
    ov = watch_overrides(tmp_path, mlflow_server.uri, name, endpoints)
    pipeline = evaluated_champion(mlflow_server.uri, name, f"{name}-draft", {3: 2.5, 7: 3.2})
    a, b = endpoints
    t0 = 1.8e9

    def tick(k: int, tau: float | None) -> str:
        if tau is not None:
            a.traffic(60, tau)
            b.traffic(40, tau)
        capsys.readouterr()
        assert retrain.retrain_tick(CONFIG, ov, now=t0 + 600 * k) == 0
        return capsys.readouterr().out

    assert "first read" in tick(0, None)
    out = tick(1, 2.5)  # as evaluated at n=3 (2.5), not at the registered n=7 (3.2)
    assert "live tau 2.500 over 100 drafts vs evaluated 2.500: above the drift line 2.250" in out
    assert "fires at 2" in tick(2, 1.6) and not calls
    out = tick(3, 1.6)
    assert "drift; firing" in out and len(calls) == 1
    overrides, tags = calls[0]
    assert "train.init_from=champion" in overrides and tags["dspark.trigger"] == "drift"
    assert tags["dspark.drift.live_tau"] == "1.6000" and tags["dspark.drift.evaluated_tau"] == "2.5000"
    assert tags["dspark.drift.drafts"] == "200" and tags["dspark.drift.window"].startswith("2 ticks since ")
    assert tags["dspark.drift.endpoints"] == f"{a.url},{b.url}" and tags["dspark.drift.champion"] == f"{name}-draft v1"
    # Still low: the window fills again, then the cooldown holds; a restarted endpoint is a new base.
    assert "(fires at 2)" in tick(4, 1.6)
    b.restart()
    out = tick(5, 1.6)
    assert "counters reset (the server restarted)" in out and "cooldown" in out and len(calls) == 1
    # Past the cooldown it would fire again, but the first retrain is still running: held back,
    # and the streak stands for the tick after it ends.
    out = tick(12, 1.6)
    assert "a retrain is under way" in out and len(calls) == 1
    state = json.loads((tmp_path / "watch" / f"{name}.watch.json").read_text())
    assert len(state["streak"]) == 3 and state["last_fire"] == t0 + 1800

    client = MlflowClient(mlflow_server.uri)
    exp = client.get_experiment_by_name(name)
    [serving] = [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get(STAGE) == "serving"]
    assert serving.data.tags[PARENT_RUN_ID] == pipeline and serving.data.tags["dspark.champion"] == f"{name}-draft v1"
    live = client.get_metric_history(serving.info.run_id, "serving/live_tau")
    assert [round(m.value, 3) for m in sorted(live, key=lambda m: m.step)] == [2.5, 1.6, 1.6, 1.6, 1.6, 1.6]
    assert "serving/live_tau.png" in {f.path for f in client.list_artifacts(serving.info.run_id, "serving")}
    # The fired retrain's parent run carries the evidence (fake_submit made it as submit would).
    [fired] = [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("dspark.trigger") == "drift"]
    assert fired.data.tags["dspark.drift.live_tau"] == "1.6000"
    # The token: sent in the header, and nowhere else.
    assert all(h.get("Authorization") == f"Bearer {TOKEN}" for s in endpoints for h in s.seen)
    for r in client.search_runs([exp.experiment_id]):
        assert TOKEN not in json.dumps([r.data.params, r.data.tags])
    written = [p.read_text() for p in tmp_path.rglob("*") if p.is_file()]
    assert written and not any(TOKEN in text for text in written)
    cfg = resolve(CONFIG, ov)
    listed = last_tick(str(Path(cfg.cluster.log_dir).resolve() / "schedule"), name)
    assert listed.startswith("trigger drift; last tick ") and "a retrain is under way" in listed


def test_silent_endpoints_never_fire_and_a_missing_evaluation_is_one_line(mlflow_server, endpoints, tmp_path,
                                                                          monkeypatch, capsys):
    from hpc.launch.launch_checks import resolve

    monkeypatch.setenv("DSPARK_TEST_SERVE_TOKEN", TOKEN)
    calls = fake_submit(monkeypatch)
    name = f"watch-{uuid.uuid4().hex[:8]}"
    ov = watch_overrides(tmp_path, mlflow_server.uri, name, endpoints, "serve.window=1", "serve.min_drafts=0")
    evaluated_champion(mlflow_server.uri, name, f"{name}-draft", {3: 2.5, 7: 3.2})
    for s in endpoints:
        s.status = 503
    for k in range(3):
        assert retrain.retrain_tick(CONFIG, ov, now=1.8e9 + k) == 0
    out = capsys.readouterr().out
    assert out.count("none of the 2 endpoint(s) answered; nothing to judge") == 3 and not calls
    # The token: refused by the endpoints is one line each, never a fire.
    monkeypatch.setenv("DSPARK_TEST_SERVE_TOKEN", "wrong")
    for s in endpoints:
        s.status = 200
    retrain.retrain_tick(CONFIG, ov, now=1.8e9 + 10)
    assert capsys.readouterr().out.count("no answer (refused the token)") == 2 and not calls
    # Served at an n the champion was never evaluated at: validate says so, naming the key.
    cfg = resolve(CONFIG, [*ov, "serve.num_speculative_tokens=5"])
    why = retrain.check_champion(cfg)
    assert why.startswith(f"serve.num_speculative_tokens = 5: the champion {name}-draft v1 has no evaluation at n=5")
    # No champion at all: drift alone can never judge (an error); with both, new data trains one.
    lone = resolve(CONFIG, [*ov, f"tracking.registered_model={name}-none"])
    assert "no champion in the registry" in retrain.check_champion(lone)
    both = resolve(CONFIG, [*ov, f"tracking.registered_model={name}-none", "schedule.trigger=both"])
    assert retrain.check_champion(both) is None and "warning:" in capsys.readouterr().err
    with pytest.raises(UserError, match="serve.endpoints is empty"):
        retrain.watch(CONFIG, [*ov, "serve.endpoints=[]", "schedule.trigger=cron"])
