"""scripts/gpu-check runs its whole GPU script on CPU at toy dims, so it cannot rot between GPU sessions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu-check"


@pytest.mark.slow
def test_gpu_check_small_on_cpu_passes_every_check(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--small", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["check"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"flex vs tiled SDPA", "train step seq 256", "train step seq 512", "compile stability",
                         "checkpoint save + load", "calibrate pass", "confidence fold",
                         "planes (1-rank world)", "stream receive buffers", "capture gather + copy"}
    assert all(r["status"] == "PASS" for r in rows.values()), rows
    assert rows["flex vs tiled SDPA"]["data"]["max_abs_diff"] < 1e-4
    assert rows["train step seq 512"]["data"]["plan_bytes"] > 0  # set against `dspark plan`'s estimate
    assert "checker refuses cpu tensor on data plane" in rows["planes (1-rank world)"]["figures"]
    assert rows["calibrate pass"]["data"]["slots"] > 0  # held_out_slots over the longest row, then the fit
    assert rows["stream receive buffers"]["data"]["bad"] == 0
    assert rows["confidence fold"]["data"]["max_abs_diff"] <= 1e-5 and rows["confidence fold"]["data"]["fit_s"] >= 0
    assert "10/10 checks passed" in proc.stdout


def test_gpu_check_without_cuda_says_so_in_one_line():
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "no CUDA device" in proc.stderr
