"""`dspark-dev bench train-step`: the table, the missing-venv message, and a tiny real run."""

from __future__ import annotations

import pytest

from hpc_dev import bench_speculators as bench
from hpc_dev.dev_cli import main
from tests.fixtures.speculators import speculators_python  # noqa: F401  (fixture)


def test_missing_speculators_venv_is_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("DSPARK_SPECULATORS_VENV", str(tmp_path / "absent"))
    assert main(["bench", "train-step"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "hpc_dev.speculators_env" in err


def test_table_and_ratios():
    # ours: median 2, best 1; speculators: median 4, best 3. tokens/s ratios: 4/2 median, 3/1 best.
    text = bench.format_train_step({"config": "c", "tokens_per_step": 100,
                                    "times": {"ours": [1.0, 2.0, 2.0, 2.5, 3.0], "speculators": [3.0, 4.0, 4.0, 5.0, 6.0]}})
    assert "ours" in text and "speculators" in text
    assert text.splitlines()[-1].endswith("2.00 median, 3.00 best")


@pytest.mark.slow
def test_tiny_train_step_runs_both_implementations(speculators_python, capsys):
    rc = main(["bench", "train-step", "--hidden", "64", "--seq-len", "64", "--batch", "2", "--anchors", "8",
               "--draft-vocab", "128", "--target-vocab", "256", "--markov-rank", "8", "--iters", "5", "--warmup", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "ratio ours/speculators" in out
