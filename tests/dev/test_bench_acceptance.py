"""`dspark-dev bench acceptance`: the budget check, the table and ratios by hand, and a quick real run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hpc.evaluate.harness import BenchResult
from hpc_dev import bench_acceptance as ba
from hpc_dev.dev_cli import main

ROOT = Path(__file__).resolve().parents[2]


def result(label: str, n: int, bench: str, tau: float, per_position: list[float] | None = None) -> BenchResult:
    return BenchResult(benchmark=bench, rows=2, sha256="x", source="fixture", engine="reference", label=label,
                       method="dspark", n=n, tok_s=1.0, output_tokens=10, wall_s=1.0, max_tokens=16,
                       accept_len=tau, per_position=per_position or [])


def test_a_budget_too_small_names_the_minimum(capsys):
    assert main(["bench", "acceptance", "configs/toy-cpu.yaml", "--steps", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"at least --steps {ba.MIN_STEPS}" in err
    assert main(["bench", "acceptance", "configs/toy-cpu.yaml", "--toy", "--traffic", "-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--traffic -1: give 0 or more" in err


def test_a_failure_ends_the_parent_run_failed_not_running(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    def oom(*_a, **_k):
        raise RuntimeError("out of memory while training DSpark")

    from hpc.config import load_config, to_object

    monkeypatch.setattr(ba, "train_variant", oom)
    # No toy target built: the config is read as written (what it names is not looked at).
    monkeypatch.setattr(ba, "_resolve", lambda config, overrides: to_object(load_config(config, overrides)))
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    with pytest.raises(RuntimeError, match="out of memory"):
        ba.run(ba_args(tmp_path, [f"tracking.uri={uri}"]))
    client = MlflowClient(uri)
    [parent] = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert parent.info.status == "FAILED"
    assert parent.data.tags["dspark.outcome"] == "bench acceptance failed: out of memory while training DSpark"


def ba_args(tmp_path: Path, overrides: list[str]):
    import argparse

    p = argparse.ArgumentParser()
    ba.add_args(p)
    return p.parse_args(["configs/toy-cpu.yaml", *overrides, "--quick", "--out", str(tmp_path / "bench")])


def test_table_means_and_ratios_by_hand():
    results = {
        "eval-n7-DSpark": [result("DSpark", 7, "gsm8k", 3.0, [0.8, 0.5]), result("DSpark", 7, "aime", 2.0, [0.6, 0.3])],
        "eval-n7-DFlash": [result("DFlash", 7, "gsm8k", 2.0), result("DFlash", 7, "aime", 2.0)],
        "eval-n7-ngram": [result("ngram", 7, "gsm8k", 1.0), result("ngram", 7, "aime", 1.5)],
        "eval-n3-DSpark": [result("DSpark", 3, "gsm8k", 2.5)],
        "baseline-reference": [result("baseline", 0, "gsm8k", None)],
    }
    table = ba.tau_table(results)
    assert ba.mean_tau(table, "DSpark", 7) == 2.5 and ba.mean_tau(table, "Markov-only", 7) is None
    r = ba.ratios(table)
    assert r["DFlash"] == pytest.approx(1.25) and r["ngram"] == pytest.approx(2.0) and r["Markov-only"] is None
    text = ba.format_table(table, ["gsm8k", "aime"])
    assert "DSpark / DFlash at n=7: 1.250x  meets the goal (>= 1.15)" in text
    assert "DSpark / ngram at n=7: 2.000x  meets the goal (>= 1.3)" in text
    assert "DSpark / Markov-only at n=7: -" in text
    mean_row = next(line for line in text.splitlines() if line.startswith("mean"))
    assert mean_row.split()[1:3] == ["2.50", "2.50"]  # DSpark n=3 (gsm8k only), n=7
    assert ba.per_position(results, 7)["DSpark"] == pytest.approx([0.7, 0.4])


def test_a_missed_goal_says_so():
    table = {"DSpark": {7: {"gsm8k": 2.0}}, "DFlash": {7: {"gsm8k": 1.9}}, "ngram": {7: {"gsm8k": 2.5}}}
    text = ba.format_table(table, ["gsm8k"])
    assert "DSpark / DFlash at n=7: 1.053x  misses the goal (>= 1.15)" in text
    assert "DSpark / ngram at n=7: 0.800x  misses the goal (>= 1.3)" in text


def test_calibration_lines_judge_only_positions_a_perfect_head_could_pass():
    # Position 1: confidence 0.9, always accepted (ECE 0.1); position 2: 0.5, accepted half the time (ECE 0).
    steps = [([0.9, 0.5], [1, 1])] * 200 + [([0.9, 0.5], [1, 0])] * 200
    lines, metrics = ba.calibration_lines(steps, "6 prompts")
    assert lines[0].endswith("ECE per position on 6 prompts:")
    assert lines[1].startswith("  position 1: ECE 0.100 over 400 slots") and lines[1].endswith("misses the goal (<= 0.05)")
    assert lines[3].startswith("  position 2: ECE 0.000 over 400 slots") and lines[3].endswith("meets the goal (<= 0.05)")
    # The survival to 2 compounds position 1's error: 0.45 said, 0.5 all accepted, over every step.
    assert lines[4].startswith("  survival to 2: ECE 0.050 over 400 steps") and "said 0.450, all accepted 0.500" in lines[4]
    assert len(lines) == 5 and metrics == {"ece_n7_pos1": pytest.approx(0.1), "ece_n7_pos2": 0.0,
                                           "ece_survival_n7_pos1": pytest.approx(0.1),
                                           "ece_survival_n7_pos2": pytest.approx(0.05)}
    # 40 slots at 0.5: a perfectly calibrated head reads about 0.06 there, over the goal, so no verdict.
    few = [([0.5], [1])] * 20 + [([0.5], [0])] * 20
    served, served_metrics = ba.calibration_lines(steps, "6 prompts", reading="served")
    assert "(greedy; the served head, its fold fitted on held-out rows)" in served[0]
    assert set(served_metrics) == {f"served_{k}" for k in metrics}  # both readings log side by side
    line = ba.calibration_lines(few, "2 prompts")[0][1]
    assert "ECE 0.000 over 40 slots" in line and line.endswith("too few slots to judge against 0.05"), line
    assert ba.calibration_lines([], "no prompts") == ([], {})
    # 40 slots at 0.5 that are never accepted: no count excuses that.
    line = ba.calibration_lines([([0.5], [0])] * 40, "2 prompts")[0][1]
    assert "ECE 0.500 over 40 slots" in line and "misses: above what 95% of perfectly calibrated heads read" in line


@pytest.mark.slow
def test_quick_run_trains_three_drafts_and_evaluates_them_beside_ngram(vllm_python, toy_target, tmp_path):
    from mlflow.tracking import MlflowClient

    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "hpc_dev", "bench", "acceptance", "configs/toy-cpu.yaml", "--toy", "--quick",
           "--out", str(out), f"verifier.python={vllm_python}"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1500)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    text = res.stdout
    for label in ("DSpark n=7", "DFlash n=7", "Markov-only n=7", "ngram n=7"):
        assert label in text
    assert "n=3" not in text.split("tau (mean acceptance length")[1].splitlines()[1]  # --quick: the ratios' n only
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines()
            if line.split() and line.split()[0] in ("gsm8k", "humaneval", "mean")}
    assert set(rows) == {"gsm8k", "humaneval", "mean"}
    assert all(len(v) == 4 and all(float(x) >= 1.0 for x in v) for v in rows.values()), rows  # tau >= 1 always
    assert "DSpark / DFlash at n=7:" in text and "DSpark / ngram at n=7:" in text
    for line in (ln for ln in text.splitlines() if ln.startswith("DSpark / ")):  # each ratio with its spread
        assert "x (95% CI " in line and "bootstrap over 2 prompts" in line, line
    for png in ("loss_curves.png", "per_position_n7.png"):
        assert (out / png).stat().st_size > 0
    assert not (out / "per_position_n3.png").exists()

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    parents = [r for r in runs if r.data.tags.get("dspark.bench") == "acceptance"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    parent = parents[0]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    names = {r.data.tags["mlflow.runName"] for r in children}
    assert {"train-DSpark", "train-DFlash", "train-Markov-only"} <= names
    evals = {(r.data.tags.get("dspark.draft"), r.data.tags.get("dspark.n")) for r in children
             if r.data.tags.get("dspark.n")}
    assert evals >= {(d, "7") for d in ("DSpark", "DFlash", "Markov-only", "ngram")}
    assert not any(n == "3" for _, n in evals)  # --quick: one vLLM start per draft, not two
    losses = client.get_metric_history(next(r for r in children if r.data.tags["mlflow.runName"] == "train-DFlash")
                                       .info.run_id, "loss")
    assert len(losses) == ba.MIN_STEPS
    assert "ratio_n7/DSpark_over_DFlash" in parent.data.metrics
    # Scored on every prompt the two benchmarks evaluate (6 each, the manifests' count), not the eval's one.
    # --quick does not regenerate, so the calibration set of prompts is not used: rows are held out.
    for how in ("the side file's maps,", "the served head, its fold"):  # both readings, on the same prompts
        assert (f"confidence at n=7 (greedy; {how} fitted on held-out training rows), ECE per position on 12 "
                "benchmark prompts") in text
    assert "fitted on 64 held-out rows" in text  # 640 conversations, every 10th held out
    assert (out / "DSpark" / "export" / "confidence_calibration.json").is_file()
    assert not (out / "DFlash" / "export" / "confidence_calibration.json").exists()  # no head to calibrate


def test_judged_lines_read_the_cross_fitted_ece_against_the_goal_and_its_floor():
    from hpc.calibration.fold import FoldFit
    from hpc.calibration.stage import Fitted
    from hpc.formats.calibration import Calibration, Fold

    ece = {"greedy": [(0.02, 5000.0), (0.08, 900.0), (0.03, 20.0), (0.0, 0.0)],
           "sampling": [(0.01, 4000.0), (0.02, 800.0), (0.1, 15.0), (0.0, 0.0)]}
    fitted = Fitted(Calibration({"greedy": [(1.0, 0.0)] * 4}), 3074, ece, [0.01, 0.02, 0.09, 0.0], "calibration rows")
    lines, metrics = ba.judged_lines(fitted)
    assert lines[0] == "DSpark confidence (greedy), ECE per position cross-fitted on the 3074 calibration rows:"
    assert lines[1].startswith("  position 1: ECE 0.020 over 5000 slots") and lines[1].endswith("meets the goal (<= 0.05)")
    assert lines[2].endswith("misses the goal (<= 0.05)")  # its floor (0.02) is under the goal: a real miss
    # A perfect head reads 0.09 at 20 slots: a lucky 0.03 there passes nothing.
    assert "ECE 0.030 over 20 slots" in lines[3] and lines[3].endswith("too few slots to judge against 0.05")
    assert len(lines) == 5 and lines[4] == ""  # position 4: no slot reached, no line
    assert metrics["ece_greedy_pos2"] == 0.08 and "ece_greedy_pos4" not in metrics
    assert ba.judged_lines(None) == ([], {})
    assert ba.judged_lines(Fitted(fitted.calibration, 1, None, [], "calibration rows")) == ([], {})
    nan = float("nan")
    survival = {"greedy": [(0.02, 5000.0, 0.01), (0.07, 4800.0, 0.01), (nan, 0.0, nan)], "sampling": []}
    raw = {"greedy": [(0.11, 5000.0, nan), (0.2, 4800.0, nan), (nan, 0.0, nan)], "sampling": []}
    # No fold: the head vLLM serves is the raw one, and the goal is judged on it.
    lines, metrics = ba.judged_lines(Fitted(fitted.calibration, 3074, ece, fitted.greedy_floor, "calibration rows",
                                            survival, raw))
    assert lines[4].startswith("  survival to 1 (") and lines[4].endswith("misses the goal (<= 0.05)")
    assert "served head: ECE 0.110 over 5000 blocks" in lines[4] and "side-file maps 0.020; raw head 0.110" in lines[4]
    assert len(lines) == 7 and metrics["ece_survival_greedy_pos2"] == 0.07 and "ece_survival_greedy_pos3" not in metrics
    # Folded: the served head's survival (cross-fitted) is judged, the other two read beside it.
    served = [(0.03, 5000.0, 0.01), (0.06, 4800.0, 0.01), (nan, 0.0, nan)]
    fold = FoldFit(Fold(0.8, -0.3, "greedy"), "folded sigmoid(0.8000 z - 0.3000) into the served head", served)
    lines, metrics = ba.judged_lines(Fitted(fitted.calibration, 3074, ece, fitted.greedy_floor, "calibration rows",
                                            survival, raw, fold))
    assert lines[4] == "  served head: folded sigmoid(0.8000 z - 0.3000) into the served head"
    assert "served head: ECE 0.030" in lines[5] and lines[5].endswith("meets the goal (<= 0.05)")
    assert "ECE 0.060 over 4800 blocks" in lines[6] and lines[6].endswith("misses the goal (<= 0.05)")
    assert metrics["fold_a"] == 0.8 and metrics["ece_survival_served_greedy_pos1"] == 0.03


def test_every_manifest_prompt_is_evaluated_unless_a_setting_says_otherwise(tmp_path):
    """The toy config evaluates 2 rows per benchmark; the bench compares drafts on every prompt the
    manifests ship (40), where its tau is steadier and its confidence is scored too."""
    import argparse

    from hpc.config import load_config, to_object

    def rows(*argv: str) -> int | None:
        parser = argparse.ArgumentParser()
        ba.add_args(parser)
        args = parser.parse_args(["configs/toy-cpu.yaml", *argv])
        return to_object(load_config(args.config, ba.bench_overrides(args, tmp_path))).eval.rows

    assert rows() is None
    assert rows("--quick") == 1
    assert rows("eval.rows=3") == 3
