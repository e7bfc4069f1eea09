"""The card's equal-budget table (issue 48, items 3 and 7): a pipeline's ablations side by side at
each n, DSpark's tau over each with its bootstrap interval over prompts, read from what the eval
runs logged; nothing when there are no ablations."""

from __future__ import annotations

import numpy as np
import pytest

from hpc.evaluate.compare import EvalRecord
from hpc.evaluate.equal_budget import equal_budget_markdown
from hpc.evaluate.ratios import ratio_interval
from hpc.track.keys import MEAN_ACCEPT_LEN
from tests.evaluate.test_ratios import noisy


def counts(seed: int, accept: float, prompts: int = 30) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {b: np.asarray(noisy(rng, prompts, accept), float) for b in ("gsm8k", "humaneval")}


def tau(by_bench: dict[str, np.ndarray]) -> float:
    return float(np.mean([1 + c[:, 1].sum() / c[:, 0].sum() for c in by_bench.values()]))


def ablation_run(draft: str, n: int, by_bench, pipeline: str = "p", temperature: float = 0.0) -> EvalRecord:
    # the card names our DSpark draft "dspark"; the ablations keep their labels
    return EvalRecord(pipeline, "dspark" if draft == "DSpark" else draft, n, {MEAN_ACCEPT_LEN: tau(by_bench)},
                      "dspark", "vllm", temperature, run_id=f"{pipeline}-{draft}-{n}-{temperature}")


def table_rows(md: str) -> dict[str, list[str]]:
    return {cells[0]: cells[1:] for line in md.splitlines() if line.startswith("| ") and not line.startswith("| n ")
            for cells in [[c.strip() for c in line.strip("|").split("|")]]}


def test_each_n_has_every_drafts_tau_and_dspark_over_each_with_its_interval():
    logged = {("DSpark", 3): counts(1, 2.4), ("DFlash", 3): counts(2, 1.8), ("Markov-only", 3): counts(3, 2.2),
              ("DSpark", 7): counts(4, 3.5), ("DFlash", 7): counts(5, 2.5), ("Markov-only", 7): counts(6, 3.2)}
    evals = [ablation_run(d, n, c) for (d, n), c in logged.items()]
    by_id = {e.run_id: c for e, c in zip(evals, logged.values())}
    evals.append(ablation_run("DSpark", 7, counts(7, 1.0), temperature=0.8))  # sampled: not this table's
    evals.append(EvalRecord("p", "ngram", 7, {MEAN_ACCEPT_LEN: 1.5}, "ngram", "vllm"))  # a peer, not an ablation
    md = equal_budget_markdown(evals, lambda rec: by_id.get(rec.run_id))
    assert "### Equal budget" in md and "ngram" not in md
    header = next(line for line in md.splitlines() if line.startswith("| n "))
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "n", "DSpark tau", "DFlash tau", "Markov-only tau", "DSpark / DFlash", "DSpark / Markov-only"]
    rows = table_rows(md)
    assert set(rows) == {"3", "7"}
    for n, cells in rows.items():
        mine = logged[("DSpark", int(n))]
        assert cells[0] == f"{tau(mine):.2f}"  # the greedy run's, not the sampled one's
        for rival, cell in zip(("DFlash", "Markov-only"), cells[3:]):
            theirs = logged[(rival, int(n))]
            iv = ratio_interval([{"a": {int(n): mine}, "b": {int(n): theirs}}], "a", "b", int(n))
            assert cell == f"{iv.ratio:.3f}x [{iv.lo:.3f}-{iv.hi:.3f}]"
            assert iv.ratio == pytest.approx(tau(mine) / tau(theirs))
            assert iv.lo < iv.ratio < iv.hi


def test_without_per_prompt_counts_the_ratio_prints_without_an_interval():
    evals = [ablation_run("DSpark", 7, counts(1, 3.0)), ablation_run("DFlash", 7, counts(2, 2.0))]
    (cells,) = table_rows(equal_budget_markdown(evals, lambda rec: None)).values()
    assert cells[-1] == f"{evals[0].metrics[MEAN_ACCEPT_LEN] / evals[1].metrics[MEAN_ACCEPT_LEN]:.3f}x " \
                        "(no per-prompt counts)"


def test_a_pipeline_without_ablations_has_no_such_table():
    sweep = [EvalRecord("p", "lr=0.001", 7, {MEAN_ACCEPT_LEN: 2.0}), EvalRecord("p", "lr=0.003", 7, {MEAN_ACCEPT_LEN: 2.1})]
    assert equal_budget_markdown(sweep, lambda rec: None) == ""
    alone = [ablation_run("DSpark", 7, counts(1, 3.0)), ablation_run("DFlash", 3, counts(2, 2.0))]  # no common n
    assert equal_budget_markdown(alone, lambda rec: None) == ""


def test_the_intervals_come_from_the_eval_runs_results_in_mlflow(tmp_path):
    """What the eval stage logs (results.json per run) is what the report's table reads back."""
    from dataclasses import asdict
    from types import SimpleNamespace

    from mlflow.tracking import MlflowClient

    from hpc.evaluate.compare import fetch_evals
    from hpc.evaluate.equal_budget import mlflow_per_prompt
    from hpc.evaluate.harness import BenchResult, write_json_atomic
    from hpc.evaluate.record import upload_run
    from hpc.evaluate.runner import Job, _write_meta
    from hpc.track.keys import DRAFT, METHOD, SPEC_N, STAGE, STAGE_PIPELINE, TEMPERATURE

    client = MlflowClient(f"sqlite:///{tmp_path / 'm.db'}")
    parent = client.create_run(client.create_experiment("e"), tags={STAGE: STAGE_PIPELINE}).info.run_id
    logged = {"DSpark": counts(1, 3.0), "DFlash": counts(2, 2.0)}
    for label, by_bench in logged.items():
        run_dir = tmp_path / label
        run_dir.mkdir()
        results = []
        for bench, c in by_bench.items():
            steps, acc = (int(x) for x in c.sum(0))
            results.append(BenchResult(bench, len(c), "a" * 64, "fixture", "vllm", label, "dspark", 7, 1.0, 0, 1.0, 16,
                                       verify_steps=steps, accepted_tokens=acc, accept_len=1 + acc / steps,
                                       per_prompt=c.astype(int).tolist()))
            write_json_atomic(run_dir / f"{bench}.json", asdict(results[-1]))
        tags = {DRAFT: label, METHOD: "dspark", SPEC_N: "7", TEMPERATURE: "0"}
        _write_meta(run_dir, SimpleNamespace(experiment="e", registered_model=None), Job(None, 7, "vllm"), "eval",
                    parent, tags, results)
        upload_run(client, run_dir)
    evals = fetch_evals(client, [client.get_run(parent)])
    (cells,) = table_rows(equal_budget_markdown(evals, mlflow_per_prompt(client))).values()
    iv = ratio_interval([{"a": {7: logged["DSpark"]}, "b": {7: logged["DFlash"]}}], "a", "b", 7)
    assert cells[-1] == f"{iv.ratio:.3f}x [{iv.lo:.3f}-{iv.hi:.3f}]"
