"""`dspark bench NAME`: benchmarks that print figures, each as a ratio against a peer run.

A benchmark is a (configure parser, run) pair in BENCHMARKS; `train-step` is the first. More
(`toy-target`, `stream`) add an entry, not a new command.

train-step: tokens/s of OUR DSpark training step (forward + backward + AdamW) against
speculators 0.9.0's on the identical config, weights and batch. Both run in ONE process of the
speculators venv (hpc/bench_train_step.py, our code on PYTHONPATH), iterations interleaved, so
they share the machine's state; we report medians and the ratio ours/theirs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import hpc

REPO = Path(hpc.__file__).resolve().parents[1]
# The speculators venv is built by test code (its pins clash with ours); a source checkout has it.
SPECULATORS_ENV = REPO / "tests" / "peers" / "speculators_env.py"


def _speculators_env() -> ModuleType | None:
    if not SPECULATORS_ENV.is_file():
        return None
    spec = importlib.util.spec_from_file_location("_dspark_speculators_env", SPECULATORS_ENV)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def speculators_python() -> Path | None:
    """The ready speculators venv's interpreter, or None (never builds: that takes minutes)."""
    env = _speculators_env()
    if env is None or not env.is_ready():
        return None
    return env.venv_python(env.default_venv_dir())


# -- train-step ------------------------------------------------------------------------------
def _train_step_args(p: argparse.ArgumentParser) -> None:
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


def _run_train_step(args: argparse.Namespace) -> int:
    py = speculators_python()
    if py is None:
        print(f"speculators venv not built: run `.venv/bin/python -m tests.peers.speculators_env` in {REPO} "
              f"(~3 min), or set DSPARK_SPECULATORS_VENV to one", file=sys.stderr)
        return 2
    if args.iters < 5:
        print("--iters must be >= 5 for a meaningful median", file=sys.stderr)
        return 2
    cfg = {k: v for k, v in vars(args).items() if k not in ("func", "command", "bench")}
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([str(py), "-m", "hpc.bench_train_step", json.dumps(cfg)], env=env, cwd=REPO,
                          stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        print(f"benchmark worker failed (exit {proc.returncode})", file=sys.stderr)
        return 1
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(format_train_step(result))
    return 0


def format_train_step(result: dict) -> str:
    tokens = result["tokens_per_step"]
    lines = [f"train-step: {result['config']}",
             f"{'impl':<12}{'median s':>10}{'min s':>9}{'max s':>9}{'tokens/s':>11}  n"]
    rate = {}
    for impl in ("ours", "speculators"):
        times = result["times"][impl]
        med = statistics.median(times)
        rate[impl] = tokens / med
        lines.append(f"{impl:<12}{med:>10.3f}{min(times):>9.3f}{max(times):>9.3f}{rate[impl]:>11.0f}  {len(times)}")
    best = min(result["times"]["speculators"]) / min(result["times"]["ours"])
    # On a shared machine the best iteration is the least disturbed estimate; both are shown.
    lines.append(f"ratio ours/speculators (tokens/s): {rate['ours'] / rate['speculators']:.2f} median, {best:.2f} best")
    return "\n".join(lines)


# -- toy-target ------------------------------------------------------------------------------
def _toy_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=300.0, help="the build-time goal on 2 cores")


def _run_toy_target(args: argparse.Namespace) -> int:
    """Cold build of both toy targets into an empty cache, then the warm (cached) peer call."""
    import tempfile
    import time

    from hpc.verifier.toy import ARCHS, build_toy_target

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


# -- stream ----------------------------------------------------------------------------------
def _stream_args(p: argparse.ArgumentParser) -> None:
    from hpc.stream.bench import add_args

    add_args(p)


def _run_stream(args: argparse.Namespace) -> int:
    from hpc.stream.bench import run

    return run(args)


# -- capture ---------------------------------------------------------------------------------
def _capture_args(p: argparse.ArgumentParser) -> None:
    from hpc.verifier.capture_bench import add_args

    add_args(p)


def _run_capture(args: argparse.Namespace) -> int:
    from hpc.verifier.capture_bench import run

    return run(args)


# -- acceptance ------------------------------------------------------------------------------
def _acceptance_args(p: argparse.ArgumentParser) -> None:
    from hpc.bench_acceptance import add_args

    add_args(p)


def _run_acceptance(args: argparse.Namespace) -> int:
    from hpc.bench_acceptance import run

    return run(args)


# name -> (add arguments, run, one-line help)
BENCHMARKS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int], str]] = {
    "train-step": (_train_step_args, _run_train_step, "our DSpark training step vs speculators', tokens/s"),
    "stream": (_stream_args, _run_stream, "streamer->trainer GB/s vs a raw torch.distributed send; data-wait"),
    "capture": (_capture_args, _run_capture, "captured tokens/s at 1, 2, 4, 8 requests in flight per verifier"),
    "acceptance": (_acceptance_args, _run_acceptance,
                   "tau of DSpark vs its DFlash and Markov-only ablations and ngram, at one training budget"),
    "toy-target": (_toy_target_args, _run_toy_target, "cold build time of the toy targets vs the 5-minute budget"),
}


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="benchmarks that print figures (ratios against a peer run)")
    sub = parser.add_subparsers(dest="bench", metavar="NAME", required=True)
    for name, (add_args, run, help_text) in BENCHMARKS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_args(p)
        p.set_defaults(func=run)
