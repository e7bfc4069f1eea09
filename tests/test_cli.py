"""`dspark`'s error reporting: a bug's traceback stays, without the credentials error texts quote."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc.cli import main
from tests.fixtures.recipes import NO_VLLM

KIMI = str(Path(__file__).resolve().parents[1] / "configs" / "kimi-k2.6-dspark.yaml")


def test_an_unexpected_error_prints_its_traceback_scrubbed(monkeypatch, capsys):
    import hpc.launch.plan_cli as plan

    def broken(cfg):
        raise RuntimeError("API request to http://alice:PW14@mlflow:5000/api failed")

    monkeypatch.setattr(plan, "capacity_plan", broken)
    assert main(["plan", KIMI, *NO_VLLM]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "in broken" in err
    assert "PW14" not in err and "http://alice:***@mlflow:5000/api" in err


def test_evaluate_help_says_what_it_prints_as_written(capsys):
    """A user reads what `dspark evaluate` prints before a long run: each part, its lines intact."""
    with pytest.raises(SystemExit):
        main(["evaluate", "--help"])
    out = capsys.readouterr().out
    assert "What it prints, in order:" in out
    for part in ("  - a progress bar per (draft, n)", "  - the card, as `dspark compare` prints it",
                 "registry: NAME vN", "eval.output_dir/<run>/"):
        assert part in out, part
