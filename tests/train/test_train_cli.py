"""`dspark train`: streamer + 2 DDP trainers over gloo on this machine, logged to MLflow."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from hpc.formats.calibration import Calibration
from hpc_dev.toy_data import write_toy_conversations

ROOT = Path(__file__).resolve().parents[2]
STEPS = 120
MARGIN = 0.2


@pytest.mark.slow
def test_dspark_train_runs_the_online_pipeline(toy_target, vllm_python, mlflow_server, tmp_path):
    """vLLM verifier + streamer + 2 DDP trainers; the exported draft then clearly beats an
    untrained one in the reference evaluator."""
    import secrets as random_secrets

    data = write_toy_conversations(tmp_path / "train.jsonl", n=160, seed=1)
    out = tmp_path / "run"
    # Three planted secrets, one per way a secret is known: by its key's name, by a connection
    # string's shape under a plain name, by a vendor token's shape under a plain name.
    planted = {"HF_TOKEN": f"hf_{random_secrets.token_hex(12)}", "STORAGE": random_secrets.token_hex(16),
               "MY_VAR": f"ghp_{random_secrets.token_hex(18)}"}
    conn = f"DefaultEndpointsProtocol=https;AccountName=acct;AccountKey={planted['STORAGE']}==;EndpointSuffix=core"
    cmd = [sys.executable, "-m", "hpc", "train", "configs/toy-cpu.yaml", f"verifier.model={toy_target}",
           f"verifier.python={vllm_python}", f"data.sources=[{{path: {data}}}]", f"train.output_dir={out}",
           "train.checkpoint_interval=25", "train.lr=3e-3", f"tracking.uri={mlflow_server.uri}",
           "tracking.experiment=train-cli",
           f"verifier.env={{VLLM_CPU_KVCACHE_SPACE: '1', VLLM_ENABLE_V1_MULTIPROCESSING: '0', "
           f"HF_TOKEN: {planted['HF_TOKEN']}, "
           f"AZURE_STORAGE_CONNECTION_STRING: '{conn}', MY_VAR: {planted['MY_VAR']}}}", "--steps", str(STEPS)]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "160 rows kept" in res.stdout
    printed = res.stdout + res.stderr
    state = json.loads((out / "checkpoints" / f"step_{STEPS:08d}" / "state.json").read_text())
    # configs/toy-cpu.yaml holds every 10th row out (ids 9, 19, ...): 144 of the 160 train.
    # 960 samples = 6.7 epochs of 144. Finished epochs are forgotten; near a boundary the stream
    # mixes two epochs, so what is left is the unfinished epoch's (epoch, id) pairs, each once.
    trained = 144
    samples = STEPS * 8  # train.global_batch_size
    assert state["step"] == STEPS and state["samples_seen"] == samples
    ledger = {tuple(p) for p in state["ledger"]}
    assert len(ledger) == len(state["ledger"]) and all(e >= state["epoch"] for e, _ in ledger)
    assert state["epoch"] * trained + len(ledger) == samples
    assert state["epoch"] in (samples // trained - 1, samples // trained)
    assert ledger and not any(i % 10 == 9 for _, i in ledger)  # no held-out row was ever streamed
    assert (out / "export" / "model.safetensors").is_file() and (out / "loss_curve.png").is_file()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpc.evaluate.reference import mean_acceptance_length
    from hpc.launch.launch_checks import resolve
    from hpc.model.export import load_draft
    from hpc.train.trainer import build_draft
    from tests.dev.test_offline import chat_prompts

    cfg = resolve(ROOT / "configs" / "toy-cpu.yaml", [f"verifier.model={toy_target}", f"data.sources=[{{path: {data}}}]"],
                  check_tracking=False)
    untrained, _ = build_draft(cfg.draft, str(toy_target), out / "data" / "vocab.safetensors",
                               norm=False)
    target = AutoModelForCausalLM.from_pretrained(toy_target, dtype=torch.float32).eval()
    prompts = chat_prompts(AutoTokenizer.from_pretrained(toy_target), 8, tmp_path / "eval.jsonl")
    after, _ = mean_acceptance_length(target, load_draft(out / "export").eval(), prompts, n=7, max_new_tokens=32)
    before, _ = mean_acceptance_length(target, untrained.eval(), prompts, n=7, max_new_tokens=32)
    print(f"online training, mean acceptance length at n=7: untrained {before:.3f} -> trained {after:.3f}")
    # A short run wants a larger LR than the config's 1e-3. On the talking toy, 60 steps at 3e-3 gave
    # 1.00 -> 1.17, 120 steps 1.01 -> 1.35; offline (tests/dev/test_offline.py) 200 steps give 1.33.
    assert after > before + MARGIN

    client = MlflowClient(mlflow_server.uri)
    exp = client.get_experiment_by_name("train-cli")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.data.params["train.steps"] == str(STEPS) and run.data.params["draft.block_size"] == "8"
    assert all(run.data.params[f"verifier.env.{k}"] == "***" for k in ("HF_TOKEN", "MY_VAR",
                                                                         "AZURE_STORAGE_CONNECTION_STRING"))
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "loss")]
    assert steps == list(range(1, STEPS + 1))
    for key in ("samples_per_s", "data_wait_fraction", "accept_len", "lr", "system/cpu_percent"):
        assert key in run.data.metrics, key
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"loss_curve.png", "export", "config.yaml"} <= names
    assert run.data.metrics["rows_kept"] == 160
    assert run.info.status == "FINISHED"  # not left RUNNING
    verifier = json.loads((out / "export" / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier["architectures"] == ["Qwen3ForCausalLM"]  # the target's classes, not []

    # The calibrate stage: a vLLM verifier captures the 16 held-out rows, the map lands in the export.
    res = subprocess.run([sys.executable, "-m", "hpc", "stage", "calibrate", *cmd[4:-2]], capture_output=True, text=True,
                         cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "fitted on 16 held-out rows" in res.stdout, res.stdout
    cal = Calibration.load(out / "export")
    assert cal is not None and len(cal.maps["greedy"]) == 8 and cal.fitted_on > 0
    assert load_draft(out / "export").confidence_calibration is not None

    # Every artefact of the run: its files (logs, configs, checkpoints, the export, vLLM's log),
    # MLflow's store and artifacts (params and tags live in its database), and what it printed.
    for path in [*tmp_path.rglob("*"), *Path(mlflow_server.root).rglob("*")]:
        if path.is_file():
            body = path.read_bytes()
            assert not any(v.encode() in body for v in planted.values()), path
    assert not any(v in printed + res.stdout + res.stderr for v in planted.values())


def test_dspark_train_rejects_an_indivisible_batch(tmp_path):
    res = subprocess.run([sys.executable, "-m", "hpc", "train", "configs/toy-cpu.yaml", "train.global_batch_size=6"],
                         capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 2 and "train.global_batch_size" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.slow
def test_one_verifier_trains_the_three_ablations(toy_target, tmp_path):
    """`dspark train --ablations`: one HF verifier, DSpark, DFlash and Markov-only in v0/, v1/, v2/,
    each its own draft from the same samples; a sweep it would not run, one that changes the capture,
    or ablations beside a sweep are refused before anything starts."""
    data = write_toy_conversations(tmp_path / "train.jsonl", n=48, seed=7)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "hpc", "train", "configs/toy-cpu.yaml", f"verifier.model={toy_target}",
           "verifier.backend=hf", f"data.sources=[{{path: {data}}}]", f"train.output_dir={out}",
           "train.ranks_per_node=1", "train.global_batch_size=2", "train.grad_accumulation=1",
           "train.checkpoint_interval=6", "train.warmup_steps=2", "tracking.uri=sqlite:///" + str(tmp_path / "m.db"),
           "--steps", "6"]

    from hpc.config import ConfigError
    from hpc.errors import UserError
    from hpc.train import train_cli

    lrs = "sweep={train.lr: [1e-3, 3e-3]}"
    for share, ablations, sweep, key in (
            (False, False, lrs, "--share-verifier"),
            (True, False, "sweep={train.lr: [1e-3, 3e-3], data.max_seq_len: [96, 128]}",
             "sweep.data.max_seq_len: changes the rows captured"),
            (False, True, lrs, "submit.ablations: the config also sweeps train.lr")):
        args = argparse.Namespace(config=str(ROOT / cmd[4]), overrides=[*cmd[5:-2], sweep], steps=6,
                                  share_verifier=share, ablations=ablations)
        with pytest.raises(UserError) as err:  # in this process: the same refusal, without a start-up
            train_cli.run(args)
        lines = err.value.problems if isinstance(err.value, ConfigError) else str(err.value).splitlines()
        assert len(lines) == 1 and key in lines[0], lines
        assert not out.exists()  # refused before anything was written

    res = subprocess.run([*cmd, "--ablations"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "one verifier, 3 drafts" in res.stdout
    sent = [line for line in res.stdout.splitlines() if line.startswith("streamer ")]
    assert len(sent) == 1, sent  # one streamer fed every draft
    states = [json.loads((out / f"v{i}" / "checkpoints" / "step_00000006" / "state.json").read_text())
              for i in range(3)]
    assert all(s["step"] == 6 and s["samples_seen"] == 12 for s in states)
    assert states[0]["ledger"] == states[1]["ledger"] == states[2]["ledger"]  # the same samples, captured once
    exported = [json.loads((out / f"v{i}" / "export" / "config.json").read_text()) for i in range(3)]
    dspark, dflash, markov = exported
    assert dspark["markov_rank"] > 0 and dspark["enable_confidence_head"]  # the config's own draft
    assert dflash["speculators_model_type"] == "dflash" and "markov_rank" not in dflash  # DFlash's layout
    assert markov["markov_rank"] == dspark["markov_rank"] and not markov["enable_confidence_head"]
    client = MlflowClient("sqlite:///" + str(tmp_path / "m.db"))
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert sorted(r.data.params["eval.label"] for r in runs) == ["DFlash", "DSpark", "Markov-only"]  # a run each
    assert all(r.info.status == "FINISHED" for r in runs)
