"""`dspark-dev demo`: the whole pipeline on this machine, no Slurm, in minutes on 2 CPU cores.

The toy target is built on the fly (cached), MLflow is a SQLite file, and the stages run one
after another through submitit's local executor, exactly the stage functions a Slurm
pipeline runs: regenerate (vLLM, the training rows and a calibration set of benchmark rows no
evaluation reads), train (1 verifier + 2 trainer processes over gloo), calibrate the
confidence, evaluate at n=3 and n=7, and the report with the comparison table.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from omegaconf import OmegaConf

from hpc.config import to_yaml
from hpc.errors import UserError
from hpc.launch.launch_checks import resolve
from hpc.launch.stage_table import jobs, stage
from hpc.track.pipeline import create_pipeline_run, end_pipeline_run
from hpc_dev.toy import build_toy_target, toy_target_built
from hpc_dev.toy_data import calibration_overrides, write_toy_conversations

DEMO_LR = 3e-3
TOY_BUILD_MIN = 10  # the toy target's build on a fresh 2-core machine (its tokenizer, then its training)


def demo_stage(stage_name: str, config_file: str, parent_run_id: str, n: int | None = None) -> int:
    """One stage in a submitit local job (its own process, like a Slurm job): the entry the
    pipeline's Slurm job runs, in its one-machine form (`local=True`)."""
    cfg = resolve(config_file, [], check_tracking=False)
    code = stage(stage_name).entry(cfg, parent_run_id, n, True)
    if code:
        raise RuntimeError(f"{stage_name} failed with exit code {code}")
    return code


def run(args: argparse.Namespace) -> int:
    import submitit  # submitit: loaded only on this path
    from mlflow.tracking import MlflowClient  # mlflow: loaded only on this path

    t0 = time.monotonic()
    out = Path(args.out).resolve()
    print(f"dspark-dev demo -> {out}", flush=True)
    building = not toy_target_built(arch="qwen3", seed=0)
    if building:  # the first run on a machine: the only long quiet step, said before it starts
        print(f"building the toy target: once per machine, about {TOY_BUILD_MIN} minutes on 2 cores (cached "
              "after; a progress bar follows)", flush=True)
    target = build_toy_target(arch="qwen3", seed=0, progress=building)
    print(f"[{time.monotonic() - t0:5.0f}s] toy target ready: {target}", flush=True)
    data = write_toy_conversations(out / "data" / "train.jsonl", n=args.rows, seed=1)
    overrides = [f"verifier.model={target}", f"data.sources=[{{path: {data}}}]", f"data.output_dir={out / 'data'}",
                 f"train.output_dir={out / 'train'}", f"eval.output_dir={out / 'eval'}",
                 f"tracking.uri=sqlite:///{out / 'mlflow.db'}", "cluster.executor=local",
                 f"train.steps={args.steps}", f"train.warmup_steps={max(1, args.steps // 10)}",
                 # A short run wants a larger step than the recipe's 1e-3 (see tests/dev/test_offline.py).
                 f"train.lr={DEMO_LR}", *args.overrides]
    # The benchmark rows no evaluation reads calibrate the confidence (when the data is regenerated).
    overrides[:0] = calibration_overrides(args.config, out / "data", overrides)
    cfg = resolve(args.config, overrides, check_tracking=False)
    cfg_file = out / "config.yaml"
    cfg_file.write_text(to_yaml(OmegaConf.structured(cfg)))
    client = MlflowClient(cfg.tracking.uri)
    parent = create_pipeline_run(client, cfg, f"{cfg.name}-demo")
    ex = submitit.LocalExecutor(folder=str(out / "jobs" / "%j"))
    ex.update_parameters(timeout_min=60)
    plan = jobs(cfg)  # the pipeline's stages in the order a submit would wire them
    for i, step in enumerate(plan, start=1):
        stage, name = step.stage.name, step.name
        started = time.monotonic()
        print(f"[{started - t0:5.0f}s] stage {i}/{len(plan)}: {name}", flush=True)
        job = ex.submit(demo_stage, stage, str(cfg_file), parent, step.n)
        try:
            job.result()
        except Exception as err:  # noqa: BLE001 - the job's own log says why
            if stage != "report":  # the report ends the pipeline run itself
                end_pipeline_run(client, parent, "FAILED", f"stage {name} failed")
            raise UserError(f"demo stage {name} failed: {str(err).splitlines()[-1][:200]}; its log: "
                            f"{job.paths.stdout} and {job.paths.stderr}") from err
        if stage in ("calibrate", "report"):  # the calibration's ECE table, the comparison table
            print(job.stdout() or "", flush=True)
        print(f"[{time.monotonic() - t0:5.0f}s] {name} done in {time.monotonic() - started:.0f}s", flush=True)
    print(f"\ndemo finished in {time.monotonic() - t0:.0f}s (pipeline run {parent})")
    print(f"plots:  {out / 'train' / 'loss_curve.png'}")
    for png in sorted((out / "eval").glob("*/*.png")):
        print(f"        {png}")
    print(f"mlflow: mlflow ui --backend-store-uri sqlite:///{out / 'mlflow.db'}   (runs, metrics, artifacts, registry)")
    return 0


def register(sub) -> None:
    p = sub.add_parser("demo", help="the whole pipeline on this machine (no Slurm): toy target, train, eval, table",
                       description=__doc__)
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    p.add_argument("--config", default="configs/toy-cpu.yaml")
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    p.add_argument("--rows", type=int, default=320, help="toy conversations to train on (default 320)")
    p.set_defaults(func=run)
