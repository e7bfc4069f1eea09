"""`sbatch/retrain.sbatch`'s own logic, run as Slurm would run it on node 0 but with `srun`
replaced by a recorder: which directory each attempt writes to, and what every step is handed.
(The steps themselves run for real in test_sbatch.py's train and eval jobs.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp: Path, toy_target: Path, restart: int | None, nodes: int = 2) -> tuple[subprocess.CompletedProcess, list[str]]:
    stub = tmp / "bin"
    stub.mkdir(exist_ok=True)
    calls = tmp / "srun.log"
    calls.unlink(missing_ok=True)
    (stub / "srun").write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    (stub / "srun").chmod(0o755)
    (tmp / "train.jsonl").write_text("{}\n")  # validation wants the file to exist
    env = {**os.environ, "PATH": f"{stub}:{os.environ['PATH']}", "SLURM_JOB_ID": "42", "SLURM_NNODES": str(nodes),
           "SLURM_JOB_NODELIST": "node1", "DSPARK_PYTHON": sys.executable, "DSPARK_PARENT_RUN_ID": "parent-1"}
    env.pop("SLURM_RESTART_COUNT", None)
    if restart is not None:
        env["SLURM_RESTART_COUNT"] = str(restart)
    overrides = [f"verifier.model={toy_target}", "verifier.backend=hf", f"train.output_dir={tmp / 'out'}",
                 f"data.sources=[{{path: {tmp / 'train.jsonl'}}}]", f"data.output_dir={tmp / 'data'}",
                 "data.regenerate=false", f"tracking.uri=sqlite:///{tmp / 'mlflow.db'}"]
    res = subprocess.run(["bash", "sbatch/retrain.sbatch", "configs/toy-cpu.yaml", *overrides], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    return res, calls.read_text().splitlines() if calls.exists() else []


def test_each_job_writes_its_own_directory_and_a_requeue_resumes_it(tmp_path, toy_target):
    out = tmp_path / "out"
    (out / "retrain-42" / "train" / "checkpoints").mkdir(parents=True)  # last month's job 42: finished
    res, calls = _run(tmp_path, toy_target, restart=None)
    assert res.returncode == 0, res.stderr
    fresh = out / "retrain-42.2"
    assert [c.split(" stage ")[1].split()[0] for c in calls] == ["train", "calibrate", "eval", "eval", "report"]
    assert all(f"train.output_dir={fresh}/train eval.output_dir={fresh}/eval" in c for c in calls), calls
    assert all(c.endswith("--parent-run-id parent-1") for c in calls)
    res, calls = _run(tmp_path, toy_target, restart=1)  # preempted and requeued: the same directory
    assert res.returncode == 0 and all(f"train.output_dir={fresh}/train" in c for c in calls), calls


def test_a_wrong_node_count_stops_before_any_directory_or_step(tmp_path, toy_target):
    res, calls = _run(tmp_path, toy_target, restart=None, nodes=1)
    assert res.returncode == 2 and calls == []
    assert [line for line in res.stderr.splitlines() if line.startswith("error:")] == [
        "error: allocation has 1 node(s) but configs/toy-cpu.yaml needs cluster.verifier_nodes + "
        "cluster.trainer_nodes = 1 + 1 = 2; resubmit with sbatch --nodes=2"]
    assert not (tmp_path / "out").exists()
