"""`dspark bench stream` runs end to end and prints its figures (never asserted: they are timings)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpc", "bench", "stream", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)


@pytest.mark.slow
def test_bench_stream_prints_ratio_wait_and_host_memory_per_size():
    # Two groups: each sample goes to two trainers, against two raw sends.
    res = _bench("--samples", "4", "--repeats", "1", "--tokens", "64", "--hidden", "64", "--step-ms", "5",
                 "--groups", "2")
    assert res.returncode == 0, res.stderr[-2000:]
    title, header, row = res.stdout.splitlines()[:3]
    assert "2 groups" in title and "2 raw sends" in title
    for column in ("raw GB/s", "stream GB/s", "ratio", "data-wait", "streamer host in flight"):
        assert column in header
    # Two in flight per trainer, the default window, and each sample staged once for both trainers.
    assert row.split()[2] == "64x4x64" and "(2.0 samples)" in row


@pytest.mark.parametrize("argv, named", [(["--groups", "0"], ["--groups 0"]),
                                         (["--in-flight", "9", "--buffer", "8"], ["--in-flight 9", "--buffer"])])
def test_a_bad_flag_is_one_line_before_any_rank_starts(capsys, argv, named):
    import argparse

    from hpc.stream import stream_bench

    parser = argparse.ArgumentParser()
    stream_bench.add_args(parser)
    assert stream_bench.run(parser.parse_args(argv)) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and all(n in err for n in named)
