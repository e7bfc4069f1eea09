"""`dspark-dev toy-target`: build the CPU toy targets (see hpc_dev/toy.py)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from hpc_dev.toy import build_info, build_toy_target
from hpc_dev.toy_config import ARCHS
from hpc_dev.toy_data import write_toy_conversations
from hpc_dev.toy_report import format_report, report


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "toy-target",
        help="build tiny offline HF targets (Qwen3, DeepseekV3) that vLLM can serve on CPU",
        description="Build deterministic toy targets that talk: trained on the Python stdlib's own "
        "documentation as user/assistant exchanges. Cached by build config: a second call returns at once. "
        "With --arch all, OUT receives one directory per arch. --report says whether the target talks or loops.",
    )
    p.add_argument("out", nargs="?", type=Path, help="copy the build here (default: print the cache path)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arch", choices=[*ARCHS, "all"], default="all")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: per-arch preset)")
    p.add_argument("--cache-dir", type=Path, default=None, help="default: $DSPARK_CACHE or ~/.cache/dspark")
    p.add_argument("--conversations", type=int, default=256, help="toy chat rows written to OUT/data/train.jsonl")
    p.add_argument("--report", action="store_true",
                   help="greedy outputs on the eval fixtures: distinct-token ratio, prompt-lookup hit rate, "
                        "longest repeat, held-out perplexity (the goals a target must meet for fair acceptance figures)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    archs = list(ARCHS) if args.arch == "all" else [args.arch]
    for arch in archs:
        out = None
        if args.out is not None:
            out = args.out / arch if len(archs) > 1 else args.out
        t0 = time.perf_counter()
        path = build_toy_target(
            out, arch=arch, seed=args.seed, steps=args.steps, cache_dir=args.cache_dir, progress=True
        )
        info = build_info(path)
        print(f"{arch}: {path}  ({time.perf_counter() - t0:.1f}s)")
        print(f"  final loss {info['final_loss']:.3f}, vocab {info['vocab_size']}, mask id {info['mask_token_id']}")
        print(f"  greedy: {info['greedy_sample']!r}")
        if args.report:
            print(format_report(report(path)))
    if args.out is not None and args.arch == "all":
        data = write_toy_conversations(args.out / "data" / "train.jsonl", n=args.conversations, seed=args.seed)
        print(f"data: {data}  ({args.conversations} conversations about the stdlib, answered by its docs)")
    return 0
