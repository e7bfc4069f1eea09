"""`dspark bench stream` runs end to end and prints both ratios (figures, never asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_stream_prints_ratio_and_wait():
    res = subprocess.run([sys.executable, "-m", "hpc", "bench", "stream", "--samples", "4", "--repeats", "1",
                          "--tokens", "64", "--hidden", "64", "--step-ms", "5"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "ratio to raw" in res.stdout and "data-wait fraction" in res.stdout
