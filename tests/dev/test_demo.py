"""`dspark-dev demo` end to end, shrunk: the same stages through submitit's local executor."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_demo_runs_every_stage_and_prints_the_table(toy_target, tmp_path):
    res = subprocess.run([sys.executable, "-m", "hpc_dev", "demo", "--out", str(tmp_path / "demo"), "--steps", "4",
                          "--rows", "24", "data.regenerate=false", "verifier.backend=hf", "eval.compare=[]",
                          "eval.rows=1", "eval.max_tokens=16", "eval.code_max_tokens=16", "eval.timing_min_pairs=2",
                          "eval.benchmarks=[gsm8k,humaneval]"],
                         capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    # The stages the demo ran are the table's for the config it ran (hpc/launch/stage_table.py).
    from hpc.launch.launch_checks import resolve
    from hpc.launch.stage_table import jobs

    ran = re.findall(r"stage \d+/\d+: (\S+)", out)
    want = [j.name for j in jobs(resolve(str(tmp_path / "demo" / "config.yaml"), [], check_tracking=False))]
    assert ran == want == ["train", "calibrate", "eval-n3", "eval-n7", "report"], out
    # 24 rows, every 10th held out (configs/toy-cpu.yaml): two calibrate the head, and the export carries it.
    assert "fitted on 2 held-out rows" in out
    assert (tmp_path / "demo" / "train" / "export" / "confidence_calibration.json").is_file()
    assert "| benchmark" in out and "DSpark n=3" in out and "DSpark n=7" in out and "| gsm8k" in out
    assert "loss_curve.png" in out and "per_position_acceptance.png" in out and "demo finished" in out
    assert (tmp_path / "demo" / "train" / "export" / "model.safetensors").is_file()
