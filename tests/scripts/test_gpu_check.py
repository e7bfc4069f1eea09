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
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--small", "--gpus", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["check"]: r for r in json.loads(out.read_text())["rows"]}
    steps = [f"train step {t} x {a}" for t, a in ((256, 32), (320, 16), (384, 24), (512, 32), (512, 16))]
    assert set(rows) == {"flex vs tiled SDPA", *steps, "compile stability",
                         "checkpoint save + load", "calibrate pass", "confidence fold",
                         "calibrate (fresh process)", "time-slicing",
                         "planes (1-rank world)", "stream receive buffers", "capture gather + copy",
                         "stream staging", "DDP (2 ranks)", "NCCL stream (2 ranks)"}
    assert all(r["status"] == "PASS" for r in rows.values()), rows
    assert rows["flex vs tiled SDPA"]["data"]["max_abs_diff"] < 1e-4
    for name in steps:  # the live-tensor peak on CPU, against `dspark plan` for the same step and dtype
        data = rows[name]["data"]
        assert 0.85 <= data["peak_bytes"] / data["plan_bytes"] <= 1.15, (name, data)
    peaks = {name: rows[name]["data"]["peak_bytes"] for name in steps}
    assert peaks[steps[3]] > peaks[steps[4]]  # more anchors, more memory: the peak is measured, not the plan
    # The device rule fires on CPU too: the gloo data plane is checked as the NCCL one it stands for.
    assert "checker refuses cpu tensor on data plane" in rows["planes (1-rank world)"]["figures"]
    # gloo cannot send to itself; a checker refusal there (our own code broke a rule) would FAIL the row
    assert "data self-send n/a" in rows["planes (1-rank world)"]["figures"]
    assert "exact: True" in rows["stream staging"]["figures"]
    assert rows["calibrate pass"]["data"]["slots"] > 0  # held_out_slots over the longest row, then the fit
    assert rows["stream receive buffers"]["data"]["bad"] == 0
    assert rows["confidence fold"]["data"]["max_abs_diff"] <= 1e-5 and rows["confidence fold"]["data"]["fit_s"] >= 0
    # Two gloo ranks, each on its own rows, end with bit-identical weights: DDP averaged them.
    ddp = rows["DDP (2 ranks)"]["data"]["ranks"]
    assert all(r["same"] and r["moved"] for r in ddp) and ddp[0]["rows"] != ddp[1]["rows"]
    assert rows["NCCL stream (2 ranks)"]["data"]["bytes"] > 0 and "goals judged on GPUs only" in \
        rows["NCCL stream (2 ranks)"]["figures"]
    # The calibrate stage in a process of its own, from an export on disk; the GEMM loop beside a
    # second process doing the streamer's work (on CPU the figures are the cores', the code the GPU's)
    assert rows["calibrate (fresh process)"]["data"]["slots"] > 0
    assert rows["calibrate (fresh process)"]["data"]["rss_peak"] > 0
    ts = rows["time-slicing"]["data"]
    assert ts["alone_s"] > 0 and ts["beside_s"] > 0 and 0 <= ts["slowdown"] < 1  # what validate takes for the key
    assert f"set plan.timeslice_slowdown={ts['slowdown']:.3f}" in rows["time-slicing"]["figures"]
    assert "18/18 checks passed" in proc.stdout


def test_gpu_check_without_cuda_says_so_in_one_line():
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "no CUDA device" in proc.stderr


def test_a_budget_below_the_checks_is_one_line_before_anything_runs():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--budget", "30"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "--budget 30 s" in proc.stderr
    assert proc.stdout == ""  # refused before the first check
    # The two-GPU checks add their time: a budget that covers one GPU's checks does not cover both.
    one = subprocess.run([sys.executable, str(SCRIPT), "--budget", "400"], capture_output=True, text=True, timeout=120)
    two = subprocess.run([sys.executable, str(SCRIPT), "--budget", "400", "--gpus", "2"], capture_output=True,
                         text=True, timeout=120)
    assert "--budget" not in one.stderr and "--budget 400 s" in two.stderr and two.returncode == 2
