"""`dspark-dev bench toy-target`: cold build time of the toy targets against the 5-minute budget,
and the warm (cached) call beside it."""

from __future__ import annotations

import argparse
import tempfile
import time

from hpc_dev.toy import build_toy_target
from hpc_dev.toy_config import ARCHS


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=300.0, help="the build-time goal on 2 cores")


def run(args: argparse.Namespace) -> int:
    """Cold build of both toy targets into an empty cache, then the warm (cached) peer call."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="dspark-bench-toy-") as cache:
        for arch in ARCHS:
            t0 = time.perf_counter()
            build_toy_target(arch=arch, seed=args.seed, cache_dir=cache, progress=True)
            cold = time.perf_counter() - t0
            t0 = time.perf_counter()
            build_toy_target(arch=arch, seed=args.seed, cache_dir=cache)
            rows.append((arch, cold, time.perf_counter() - t0))
    total = sum(r[1] for r in rows)
    print(f"{'arch':<14}{'cold s':>9}{'warm s':>9}")
    for arch, cold, warm in rows:
        print(f"{arch:<14}{cold:>9.1f}{warm:>9.3f}")
    print(f"total cold build {total:.1f} s = {total / args.budget_s:.2f} x the {args.budget_s:.0f} s budget")
    return 0
