"""`dspark bench share CONFIG [KEY=VALUE ...] --groups K`: what sharing one verifier costs a draft.

Two Slurm training jobs of CONFIG, `--steps` steps each, one after the other so that neither
waits on the other's nodes: the draft alone (V + T nodes), then K variants of it trained from
one verifier's capture (`submit.share_verifier`, V + K x T nodes). The variants differ in
`train.lr` only, which changes what a step learns and not what it costs, so each variant's
samples/s against the lone draft's is the price of sharing. Rates are the steady ones each
trainer's rank 0 reports (progress.json, from its first step's end: the verifier's start does
not count), with the share of time it waited for data. Only the train jobs are submitted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from hpc.errors import UserError
from hpc.launch.launch_checks import resolve
from hpc.launch.slurm import cancel
from hpc.launch.stage_table import run_stage
from hpc.launch.status import ENDED
from hpc.launch.submit import Pipeline, _executor, plan_pipeline, train_dirs
from hpc.tables import text_table

LR_STEPS = (1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625, 0.0078125)  # variant i trains at lr x LR_STEPS[i]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    p.add_argument("--groups", type=int, default=3, help="K: drafts trained from the one verifier (default 3)")
    p.add_argument("--steps", type=int, default=80, help="training steps of each job (default 80)")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="give up on a job after this long (default 3600)")


def plans(config: str, overrides: list[str], groups: int, steps: int) -> tuple[list[str], list[str]]:
    """The overrides of the lone run and of the shared one; refuses, before anything is submitted,
    what would make the two runs differ in more than the sharing."""
    if not 2 <= groups <= len(LR_STEPS):
        raise UserError(f"--groups {groups}: between 2 and {len(LR_STEPS)} drafts on one verifier")
    base = resolve(config, overrides, check_tracking=False)
    if base.sweep or base.submit.ablations:
        raise UserError("dspark bench share makes its own sweep (train.lr); drop the config's sweep and "
                        "submit.ablations for the bench")
    # A short job: the recipe's warm-up may be longer than the whole of it (a step costs the same).
    common = [*overrides, f"train.steps={steps}", f"train.warmup_steps={min(base.train.warmup_steps, steps // 4)}",
              f"train.checkpoint_interval={steps}"]
    lrs = ",".join(f"{base.train.lr * f:g}" for f in LR_STEPS[:groups])
    return common, [*common, f"sweep.train.lr=[{lrs}]", "submit.share_verifier=true"]


def submit_train(p: Pipeline) -> Any:
    """The pipeline's train job alone, with no parent run: submitit's job."""
    [train] = [s for s in p.stages if s.name == "train"]
    ex = _executor(p.root / "logs", train.params, None, 1)
    name, file, *rest = train.calls[0]
    return ex.submit(run_stage, name, file, None, *rest)


def wait_job(job: Any, dirs: list[Path], timeout_s: float, what: str) -> None:
    """Until the job ends, a line of progress every 15 s; a job that fails or runs over raises."""
    job_id = job.job_id
    t0, said = time.monotonic(), 0.0
    # Slurm's state, not submitit's done(): that is true once the tasks wrote their results,
    # while the job may still be RUNNING (its epilog).
    while (state := job.state.split()[0].upper()) not in ENDED:
        if time.monotonic() - t0 > timeout_s:
            cancel([job_id])
            raise UserError(f"bench share: the {what} job {job_id} ran over --timeout-s {timeout_s:g}; cancelled it")
        if time.monotonic() - said >= 15:
            steps = [read_progress(d).get("step", 0) for d in dirs]
            print(f"  {what}: job {job_id} {state.lower()}, steps {steps}", flush=True)
            said = time.monotonic()
        time.sleep(2)
    if state != "COMPLETED":
        raise UserError(f"bench share: the {what} job {job_id} ended {state}; its log: {job.paths.stdout}")


def read_progress(train_dir: Path) -> dict:
    try:
        return json.loads((train_dir / "progress.json").read_text())
    except (OSError, ValueError):
        return {}


def table(alone: dict, shared: list[dict], labels: list[str]) -> tuple[list[str], list[float]]:
    """The printed lines, and each variant's samples/s as a share of the lone draft's."""
    def wait(p: dict) -> str:
        return f"{p['data_wait_fraction']:.0%}" if p.get("data_wait_fraction") is not None else "-"
    ratios = [got["samples_per_s"] / alone["samples_per_s"] for got in shared]
    rows = [["alone", f"{alone['samples_per_s']:.2f}", wait(alone), ""]]
    rows += [[label, f"{got['samples_per_s']:.2f}", wait(got), f"{r:.2f}"]
             for label, got, r in zip(labels, shared, ratios, strict=True)]
    return text_table(["run", "samples/s", "data wait", "shared / alone"], rows, right={1, 2, 3}), ratios


def run(args: argparse.Namespace) -> int:
    solo_over, shared_over = plans(args.config, list(args.overrides), args.groups, args.steps)
    solo_cfg, solo = plan_pipeline(args.config, solo_over, "bench-share-alone")  # validated, laid out:
    shared_cfg, shared = plan_pipeline(args.config, shared_over, f"bench-share-k{args.groups}")  # both, first
    runs = (("alone", solo, train_dirs(solo_cfg, solo)),
            (f"shared by {args.groups}", shared, train_dirs(shared_cfg, shared)))
    print(f"dspark bench share: {args.config}, {args.steps} steps a job: the draft alone, then {args.groups} drafts "
          "from one verifier", flush=True)
    for what, p, dirs in runs:
        [train] = [s for s in p.stages if s.name == "train"]
        job = submit_train(p)
        print(f"{what}: train job {job.job_id} on {train.params['nodes']} nodes", flush=True)
        wait_job(job, dirs, args.timeout_s, what)
    alone = read_progress(runs[0][2][0])
    got = [read_progress(d) for d in runs[1][2]]
    if not alone.get("samples_per_s") or not all(g.get("samples_per_s") for g in got):
        raise UserError("bench share: a job ended without its progress.json rate; see its log under "
                        f"{solo.root / 'logs'} or {shared.root / 'logs'}")
    labels = [f"v{i} {label or ' '.join(o)}" for i, (label, o) in
              enumerate(zip(shared.labels, shared.variant_overrides, strict=True))]
    rows, ratios = table(alone, got, labels)
    print("\n".join(rows))
    print(f"per-draft samples/s shared / alone: lowest {min(ratios):.2f}, median {statistics.median(ratios):.2f} "
          f"({args.groups} drafts, {args.steps} steps each)")
    return 0
