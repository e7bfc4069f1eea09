"""`dspark stage all CONFIG [KEY=VALUE ...]`: the pipeline's stages in one Slurm allocation.

What every sbatch/ script runs in its batch step. The stages, their order and their
dependencies are the table's (`stage_table.jobs`), the same `dspark submit` lays out as Slurm
jobs: here each runs in turn under `srun` on the nodes its row asks for (`dspark stage NAME`
in each task), and a dependency is checked by the exit codes before it. So a single-job retrain
runs what a submitted pipeline runs, eval-adaptive included.

- `--only train` (or a comma list) runs those stages alone: the per-stage sbatch scripts.
- `--fresh-dir retrain` writes under train.output_dir/retrain-<job id>/{train,eval}: a requeue
  of the same job resumes its own checkpoints, and the next scheduled job starts fresh instead
  of "resuming" a finished run (a reused job id gets retrain-<job id>.2).
- The MLflow parent run: `--parent-run-id`, else $DSPARK_PARENT_RUN_ID, else the one this job
  made on an earlier attempt, else, for a whole pipeline (train to report), a new one; without
  one, each stage logs its own runs (and a lone report says it needs one).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hpc.config.schema import DSparkConfig
from hpc.errors import EXIT_REQUEUE, UserError
from hpc.launch.launch_checks import resolve
from hpc.launch.slurm_env import attempt_dir
from hpc.launch.stage_table import NAMES, Job, jobs

OK_KINDS = ("afterok", "aftercorr")  # the dependency held only if the job it names succeeded


def selected(cfg: DSparkConfig, only: list[str] | None, n: int | None) -> list[Job]:
    """The table's jobs for this config, narrowed to `only`; with `n`, one job per per-n stage at
    that n (as `dspark stage eval --n N` runs any n)."""
    unknown = [s for s in only or [] if s not in NAMES]
    if unknown:
        raise UserError(f"--only {','.join(unknown)}: no such stage; one of {', '.join(NAMES)}", exit_code=2)
    out: list[Job] = []
    for j in jobs(cfg):
        if only and j.stage.name not in only:
            continue
        if n is not None and j.stage.per_n:
            if any(o.stage is j.stage for o in out):
                continue
            j = Job(f"{j.stage.name}-n{n}", j.stage, n, j.after)
        out.append(j)
    if not out:
        raise UserError(f"nothing to run: --only {','.join(only or [])} names no stage this config enables "
                        f"({', '.join(j.name for j in jobs(cfg))})", exit_code=2)
    return out


def srun_command(job: Job, cfg: DSparkConfig, config: str, overrides: list[str], parent: str | None) -> list[str]:
    """One `srun` per job: one task per node, on the nodes the stage's row asks for."""
    s = job.stage
    nodes = s.nodes(cfg.cluster)
    cmd = ["srun", f"--nodes={nodes}", "--ntasks-per-node=1"] + (["--kill-on-bad-exit=1"] if s.kill_on_bad_exit else [])
    cmd += [sys.executable, "-m", "hpc", "stage", s.name, config, *overrides]
    if job.n is not None:
        cmd += ["--n", str(job.n)]
    return cmd + (["--parent-run-id", parent] if parent else [])


def _parent(cfg: DSparkConfig, given: str | None, run_dir: Path | None, needed: bool) -> str | None:
    parent = given or os.environ.get("DSPARK_PARENT_RUN_ID") or None
    saved = run_dir / "parent-run-id" if run_dir is not None else None
    if not parent and saved is not None and saved.is_file():
        parent = saved.read_text().strip() or None  # a requeued attempt keeps the first attempt's
    if parent or not needed:
        return parent
    from mlflow.tracking import MlflowClient  # mlflow: loaded only on this path

    from hpc.config.secrets import redact_uri, scrub  # with the parent's client: loaded only on this path
    from hpc.track.pipeline import create_pipeline_run  # mlflow: loaded only on this path

    name = f"{cfg.name}-{run_dir.name}" if run_dir is not None else None
    try:
        parent = create_pipeline_run(MlflowClient(cfg.tracking.uri), cfg, name)
    except Exception as err:  # noqa: BLE001 - any client failure is the same one line
        raise UserError(f"could not create the MLflow parent run at {redact_uri(cfg.tracking.uri)} "
                        f"({scrub(str(err).splitlines()[0])[:200]}); fix tracking.uri or set DSPARK_PARENT_RUN_ID",
                        exit_code=2) from None
    if saved is not None:
        saved.parent.mkdir(parents=True, exist_ok=True)
        saved.write_text(parent + "\n")
    return parent


def run_all(config: str, overrides: list[str], only: list[str] | None = None, n: int | None = None,
            parent_run_id: str | None = None, fresh_dir: str | None = None) -> int:
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        raise UserError("dspark stage all runs inside a Slurm allocation: submit it with sbatch (sbatch/*.sbatch)",
                        exit_code=2)
    restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    print(f"dspark stage all: job {job_id} attempt {restart + 1} on {os.environ.get('SLURM_JOB_NODELIST', '?')}",
          flush=True)
    base = resolve(config, overrides, check_tracking=False)
    if base.sweep or base.submit.ablations:  # one allocation runs one config: the others would be dropped unsaid
        what = "submit.ablations" if base.submit.ablations else f"sweep over {', '.join(sorted(base.sweep))}"
        raise UserError(f"{what}: dspark stage all runs one config in this allocation and would train the base "
                        f"alone; submit the pipeline with `dspark submit {config}` (every variant), or drop the "
                        "sweep for this job", exit_code=2)
    todo = selected(base, only, n)
    have = int(os.environ.get("SLURM_NNODES") or 1)
    for job in todo:  # every node count checked before a directory or a step exists
        need = job.stage.nodes(base.cluster)
        exact = job.stage.name == "train"  # its roles are the node indices: V + T, no more
        if need > have or (exact and need != have):
            c = base.cluster
            what = ("cluster.verifier_nodes + cluster.trainer_nodes = "
                    f"{c.verifier_nodes} + {c.trainer_nodes} = {need}") if exact else f"{need} node(s) for {job.name}"
            raise UserError(f"allocation has {have} node(s) but {config} needs {what}; resubmit with "
                            f"sbatch --nodes={need}", exit_code=2)
    run_dir = None
    if fresh_dir:
        run_dir = attempt_dir(Path(base.train.output_dir), f"{fresh_dir}-{job_id}", restart)
        # appended last, so they win over the same keys in the user's overrides
        overrides = [*overrides, f"train.output_dir={run_dir / 'train'}", f"eval.output_dir={run_dir / 'eval'}"]
    cfg = resolve(config, overrides, check_tracking=False) if run_dir else base
    # a parent of its own only for a whole pipeline: a lone report must name the pipeline it ends
    whole = {"train", "report"} <= {j.stage.name for j in todo}
    parent = _parent(cfg, parent_run_id, run_dir, needed=whole)
    names = " -> ".join(j.name for j in todo)
    print(f"dspark stage all: {names}" + (f"; parent run {parent}" if parent else "")
          + (f"; output {run_dir}" if run_dir else ""), flush=True)
    if os.environ.get("SLURM_CPUS_PER_TASK"):  # Slurm 22.05 stopped handing it to srun
        os.environ["SRUN_CPUS_PER_TASK"] = os.environ["SLURM_CPUS_PER_TASK"]
    # Slurm signals the steps (srun's tasks), not this batch step; should a USR2 reach it anyway
    # (`scancel --full`), the ranks act on it and this process must outlive them. A handler, not
    # SIG_IGN: srun, started below, must not inherit an ignored USR2.
    signal.signal(signal.SIGUSR2, lambda *_: None)
    codes: dict[str, int] = {}
    failed = 0
    for job in todo:
        held = [dep for kind, dep in job.after if dep in codes and kind in OK_KINDS and codes[dep] != 0]
        if held:
            print(f"dspark stage all: {job.name} not run: {', '.join(held)} did not succeed", flush=True)
            codes[job.name] = codes[held[0]]
            continue
        t0 = time.monotonic()
        code = subprocess.run(srun_command(job, cfg, config, overrides, parent)).returncode
        codes[job.name] = code
        print(f"dspark stage all: {job.name} exited {code} after {time.monotonic() - t0:.0f} s", flush=True)
        if code == EXIT_REQUEUE:  # node 0 checkpointed and requeued the job: the next attempt goes on
            return code
        if code != 0:
            failed = failed or code
    return failed


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--only", help="stage all: these stages alone, comma-separated (e.g. train)")
    p.add_argument("--fresh-dir", metavar="NAME",
                   help="stage all: write under train.output_dir/NAME-<job id>/{train,eval} (a scheduled retrain)")
