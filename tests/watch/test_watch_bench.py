"""`dspark bench watch --local N`: each round runs a real tick process and a bare GET of the same
endpoints, and prints both CPU figures and their ratio (the figures themselves are never asserted).
It starts its own tracking server and endpoints: that is what the bench measures against."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from hpc_dev.toy_data import write_toy_conversations

ROOT = Path(__file__).resolve().parents[2]


def test_bench_watch_times_real_ticks_against_bare_gets(toy_target, tmp_path):
    data = write_toy_conversations(tmp_path / "train.jsonl", n=4, seed=1)  # the config must validate
    res = subprocess.run([sys.executable, "-m", "hpc", "bench", "watch", "configs/toy-cpu.yaml",
                          f"verifier.model={toy_target}", f"data.sources=[{{path: {data}}}]", "--local", "3",
                          "--ticks", "2"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    out = res.stdout
    rows = [line.split() for line in out.splitlines() if re.match(r"^\s*[12]\s+\d", line)]
    assert [r[0] for r in rows] == ["1", "2"] and all(float(x) > 0 for r in rows for x in r[1:])
    # The ticks were real: the second judged the counters the local endpoints moved since the first.
    assert "the last tick said: live tau 2.000 over 600 drafts vs evaluated 2.000" in out
    assert re.search(r"3 local endpoints: a tick costs \d+\.\d\d s of CPU \(median of 2\), a bare GET of the same "
                     r"endpoints \d+\.\d\d s: \d+\.\dx", out), out
