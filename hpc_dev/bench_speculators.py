"""`dspark-dev bench train-step`: tokens/s of OUR DSpark training step (forward + backward + AdamW)
against speculators 0.9.0's on the identical config, weights and batch.

Both run in ONE process of the speculators venv (`hpc_dev/bench_train_step.py`, our code on
PYTHONPATH), iterations interleaved, so they share the machine's state; we report medians and
the ratio ours/theirs. The venv is built by `hpc_dev.speculators_env` (its pins clash with ours).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import hpc
from hpc.tables import text_table
from hpc_dev import speculators_env

REPO = Path(hpc.__file__).resolve().parents[1]


def speculators_python() -> Path | None:
    """The ready speculators venv's interpreter, or None (never builds: that takes minutes)."""
    if not speculators_env.is_ready():
        return None
    return speculators_env.venv_python(speculators_env.default_venv_dir())


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hidden", type=int, default=256, help="draft hidden size (= target hidden)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=8, help="sequences packed into one row")
    p.add_argument("--anchors", type=int, default=64, help="anchors per sequence")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--draft-vocab", type=int, default=2048)
    p.add_argument("--target-vocab", type=int, default=8192)
    p.add_argument("--markov-rank", type=int, default=64)
    p.add_argument("--iters", type=int, default=7, help="timed iterations per implementation (>= 5)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--their-attn", choices=["sdpa", "eager"], default="sdpa",
                   help="speculators' attention on CPU (its default, flex, needs a compiler)")
    p.add_argument("--teacher", action="store_true",
                   help="instead of speculators: our step with the target's logit transform (Gemma 2's norm and "
                        "soft-cap) against the identity teacher, side by side in this venv")


def run(args: argparse.Namespace) -> int:
    py = Path(sys.executable) if args.teacher else speculators_python()
    if py is None:
        print(f"speculators venv not built: run `.venv/bin/python -m hpc_dev.speculators_env` in {REPO} "
              f"(~3 min), or set DSPARK_SPECULATORS_VENV to one", file=sys.stderr)
        return 2
    if args.iters < 5:
        print("--iters must be >= 5 for a meaningful median", file=sys.stderr)
        return 2
    cfg = {k: v for k, v in vars(args).items() if k not in ("func", "command", "bench")}
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([str(py), "-m", "hpc_dev.bench_train_step", json.dumps(cfg)], env=env, cwd=REPO,
                          stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        print(f"benchmark worker failed (exit {proc.returncode})", file=sys.stderr)
        return 1
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(format_train_step(result))
    return 0


def format_train_step(result: dict) -> str:
    tokens = result["tokens_per_step"]
    rows, rate = [], {}
    base, peer = list(result["times"])
    for impl in (base, peer):
        times = result["times"][impl]
        med = statistics.median(times)
        rate[impl] = tokens / med
        rows.append([impl, f"{med:.3f}", f"{min(times):.3f}", f"{max(times):.3f}", f"{rate[impl]:.0f}", str(len(times))])
    lines = [f"train-step: {result['config']}",
             *text_table(["impl", "median s", "min s", "max s", "tokens/s", "n"], rows, right={1, 2, 3, 4})]
    best = min(result["times"][peer]) / min(result["times"][base])
    # On a shared machine the best iteration is the least disturbed estimate; both are shown.
    lines.append(f"ratio {base}/{peer} (tokens/s): {rate[base] / rate[peer]:.2f} median, {best:.2f} best")
    return "\n".join(lines)
