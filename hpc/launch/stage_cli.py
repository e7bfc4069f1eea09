"""`dspark stage NAME CONFIG [KEY=VALUE ...]`: one pipeline stage inside a Slurm job.

This is what `sbatch/*.sbatch` run under srun (and what `dspark submit` runs through
submitit): the same YAML, the same code, whichever way the job was submitted.
"""

from __future__ import annotations

import argparse

from hpc.launch.stage_table import NAMES, run_in_job


def run(args: argparse.Namespace) -> int:
    return run_in_job(args.stage, args.config, list(args.overrides), args.parent_run_id, args.n)


def register(sub) -> None:
    p = sub.add_parser("stage", help="run one pipeline stage inside a Slurm job (what sbatch/ scripts call)",
                       description=__doc__)
    p.add_argument("stage", choices=NAMES)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    p.add_argument("--parent-run-id", help="the pipeline's MLflow parent run")
    p.add_argument("--n", type=int, help="eval: num_speculative_tokens")
    p.set_defaults(func=run)
