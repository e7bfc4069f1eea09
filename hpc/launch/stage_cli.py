"""`dspark stage NAME CONFIG [KEY=VALUE ...]`: one pipeline stage inside a Slurm job.

`dspark stage all` is what `sbatch/*.sbatch` run in their batch step (hpc.launch.stage_all): it
runs the table's stages in order, each as `dspark stage NAME` under srun. `dspark submit` runs
the same entries through submitit: the same YAML, the same code, whichever way the job was
submitted.
"""

from __future__ import annotations

import argparse

from hpc.errors import UserError
from hpc.launch.stage_all import add_arguments, run_all
from hpc.launch.stage_table import NAMES, run_in_job


def run(args: argparse.Namespace) -> int:
    if args.stage == "all":
        only = [s.strip() for s in args.only.split(",") if s.strip()] if args.only else None
        return run_all(args.config, list(args.overrides), only, args.n, args.parent_run_id, args.fresh_dir)
    if args.only or args.fresh_dir:
        raise UserError(f"--only and --fresh-dir go with `dspark stage all`, not `dspark stage {args.stage}`")
    return run_in_job(args.stage, args.config, list(args.overrides), args.parent_run_id, args.n)


def register(sub) -> None:
    p = sub.add_parser("stage", help="run one pipeline stage inside a Slurm job (what sbatch/ scripts call)",
                       description=__doc__)
    p.add_argument("stage", choices=[*NAMES, "all"])
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    p.add_argument("--parent-run-id", help="the pipeline's MLflow parent run")
    p.add_argument("--n", type=int, help="eval: num_speculative_tokens (all: the per-n stages at this n only)")
    add_arguments(p)
    p.set_defaults(func=run)
