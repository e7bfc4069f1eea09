"""`dspark stage NAME CONFIG [KEY=VALUE ...]`: one pipeline stage inside a Slurm job.

This is what `sbatch/*.sbatch` run under srun (and what `dspark submit` runs through
submitit): the same YAML, the same code, whichever way the job was submitted.
"""

from __future__ import annotations

import argparse

STAGES = ("train", "eval", "report", "regenerate")


def run(args: argparse.Namespace) -> int:
    from hpc.config import resolve
    from hpc.launch import stages
    from hpc.launch.variants import check_variant_file

    check_variant_file(args.config)
    cfg = resolve(args.config, list(args.overrides), check_tracking=False, runs_here=True)
    if args.stage != "report":  # the report reads MLflow only
        cfg = stages.localize_stage(cfg)
    if args.stage == "train":
        return stages.train_allocation(cfg, args.parent_run_id)
    if args.stage == "eval":
        if args.n is None:
            from hpc.errors import UserError

            raise UserError("dspark stage eval needs --n (num_speculative_tokens), e.g. --n 7")
        return stages.eval_stage(cfg, args.n, args.parent_run_id)
    if args.stage == "report":
        return stages.report_stage(cfg, args.parent_run_id)
    return stages.regenerate_stage(cfg, args.parent_run_id)


def register(sub) -> None:
    p = sub.add_parser("stage", help="run one pipeline stage inside a Slurm job (what sbatch/ scripts call)",
                       description=__doc__)
    p.add_argument("stage", choices=STAGES)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    p.add_argument("--parent-run-id", help="the pipeline's MLflow parent run")
    p.add_argument("--n", type=int, help="eval: num_speculative_tokens")
    p.set_defaults(func=run)
