"""`dspark train`: streamer + 2 DDP trainers over gloo on this machine, logged to MLflow."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from mlflow.tracking import MlflowClient

from hpc.verifier.toy_data import write_toy_conversations

ROOT = Path(__file__).resolve().parents[2]


def test_dspark_train_runs_the_online_pipeline(toy_target, mlflow_server, tmp_path):
    data = write_toy_conversations(tmp_path / "train.jsonl", n=64, seed=2)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "hpc", "train", "configs/toy-cpu.yaml", f"verifier.model={toy_target}",
           "verifier.backend=hf", f"data.sources=[{{path: {data}}}]", f"train.output_dir={out}",
           "train.warmup_steps=2", "train.checkpoint_interval=4", f"tracking.uri={mlflow_server.uri}",
           "tracking.experiment=train-cli", "--steps", "6"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "64 rows kept" in res.stdout
    state = json.loads((out / "checkpoints" / "step_00000006" / "state.json").read_text())
    assert state["step"] == 6 and len(state["ledger"]) == 48 == len(set(map(tuple, state["ledger"])))
    assert (out / "export" / "model.safetensors").is_file() and (out / "loss_curve.png").is_file()

    client = MlflowClient(mlflow_server.uri)
    exp = client.get_experiment_by_name("train-cli")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.data.params["train.steps"] == "6" and run.data.params["draft.block_size"] == "8"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "loss")]
    assert steps == list(range(1, 7))
    for key in ("samples_per_s", "data_wait_fraction", "accept_len", "lr", "system/cpu_percent"):
        assert key in run.data.metrics, key
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"loss_curve.png", "export", "config.yaml"} <= names
    assert run.data.metrics["rows_kept"] == 64


def test_dspark_train_rejects_an_indivisible_batch(tmp_path):
    res = subprocess.run([sys.executable, "-m", "hpc", "train", "configs/toy-cpu.yaml", "train.global_batch_size=6"],
                         capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 2 and "train.global_batch_size" in res.stderr and "Traceback" not in res.stderr
