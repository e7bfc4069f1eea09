"""A verifier that dies, hangs or never starts, on the real pipeline (real vLLM, real ranks).

None of them may pass for the end of the data: the trainers checkpoint and exit non-zero with
one line naming the cause, the MLflow run ends FAILED, and a re-run resumes and trains every
sample exactly once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from mlflow.tracking import MlflowClient

from hpc_dev.toy_data import write_toy_conversations
from tests.fixtures.wait import poll

ROOT = Path(__file__).resolve().parents[2]
STEPS, BATCH = 24, 8  # 192 samples: past three epochs of 58 rows, so a resume crosses an epoch


def train_cmd(toy_target, vllm_python, mlflow_uri, data, out, experiment, *extra) -> list[str]:
    return [sys.executable, "-m", "hpc", "train", "configs/toy-cpu.yaml", f"verifier.model={toy_target}",
            f"verifier.python={vllm_python}", f"data.sources=[{{path: {data}}}]", f"train.output_dir={out}",
            "train.checkpoint_interval=5", "stream.peer_timeout_s=8", f"tracking.uri={mlflow_uri}",
            f"tracking.experiment={experiment}", "--steps", str(STEPS), *extra]


def vllm_leader(proc: subprocess.Popen) -> psutil.Process | None:
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if any("vllm.entrypoints" in part for part in child.cmdline()):
                return child
        except psutil.NoSuchProcess:
            continue
    return None


def progress_step(out: Path) -> int:
    """The trainer's last step, 0 before its first progress file (or while it is rewritten)."""
    try:
        return json.loads((out / "progress.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return 0


def start_and_break(cmd: list[str], out: Path, sig: int, at_step: int = 6) -> tuple[int, str, str]:
    """Run `dspark train`, send `sig` to vLLM's process group once training passed `at_step`."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    leader = None

    def moment() -> str:
        nonlocal leader
        if proc.poll() is not None:
            return "exited"
        leader = leader or vllm_leader(proc)
        return "break it" if leader is not None and progress_step(out) >= at_step else ""

    if poll(moment, bool, 600, 0.2) == "break it":
        os.killpg(leader.pid, sig)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if leader is not None and sig == signal.SIGSTOP:
            try:
                os.killpg(leader.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return proc.returncode, stdout, stderr


def is_rank(child: psutil.Process) -> bool:
    """A rank process (multiprocessing's spawn child); a short-lived helper may exit while asked."""
    try:
        return any("spawn_main" in part for part in child.cmdline())
    except psutil.NoSuchProcess:
        return False


def last_error(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("error: ")]
    assert lines, stderr[-3000:]
    return lines[-1]


@pytest.mark.slow
def test_a_killed_verifier_stops_training_and_a_rerun_resumes_every_sample_once(
        toy_target, vllm_python, mlflow_server, tmp_path):
    data = write_toy_conversations(tmp_path / "train.jsonl", n=64, seed=3)
    out = tmp_path / "run"
    cmd = train_cmd(toy_target, vllm_python, mlflow_server.uri, data, out, "verifier-dies")
    code, stdout, stderr = start_and_break(cmd, out, signal.SIGKILL)
    assert code != 0, stdout[-2000:]
    line = last_error(stderr)
    assert "training stopped at step" in line and "its verifier died" in line and "resumes from it" in line, line
    stopped = json.loads((out / "stopped.json").read_text())
    assert 0 < stopped["step"] < STEPS and not (out / "export").exists()  # a short run is never exported

    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert f"resuming from {stopped['checkpoint']}" in again.stdout
    state = json.loads((out / "checkpoints" / f"step_{STEPS:08d}" / "state.json").read_text())
    # Every sample exactly once: 192 samples = 3.3 epochs of the 58 rows configs/toy-cpu.yaml trains
    # on (every 10th of the 64 is held out for the calibrate stage), nothing repeated or dropped.
    assert state["samples_seen"] == STEPS * BATCH
    # A capture that failed is in the ledger but never trained: none may have (the verifier's
    # death stops the stream, a loaded server is waited for), or the sample is lost for good.
    skipped = [ln for ln in (stdout + again.stdout).splitlines() if " skipped: " in ln]
    assert state["samples_skipped"] == 0, skipped
    ledger = [tuple(p) for p in state["ledger"]]
    assert len(set(ledger)) == len(ledger) and state["epoch"] * 58 + len(ledger) == STEPS * BATCH
    assert not any(i % 10 == 9 for _, i in ledger)

    client = MlflowClient(mlflow_server.uri)
    exp = client.get_experiment_by_name("verifier-dies")
    statuses = sorted(r.info.status for r in client.search_runs([exp.experiment_id]))
    assert statuses == ["FAILED", "FINISHED"]


@pytest.mark.slow
def test_a_hung_verifier_is_reported_within_the_peer_timeout(toy_target, vllm_python, mlflow_server, tmp_path):
    data = write_toy_conversations(tmp_path / "train.jsonl", n=64, seed=4)
    out = tmp_path / "run"
    cmd = train_cmd(toy_target, vllm_python, mlflow_server.uri, data, out, "verifier-hangs")
    code, stdout, stderr = start_and_break(cmd, out, signal.SIGSTOP)
    assert code != 0, stdout[-2000:]
    line = last_error(stderr)
    assert "stopped answering (hung)" in line and "resumes from it" in line, line
    assert "does not answer /health" in stderr  # the streamer's own line says what it saw


@pytest.mark.slow
def test_a_verifier_that_never_starts_stops_every_rank(toy_target, vllm_python, mlflow_server, tmp_path):
    data = write_toy_conversations(tmp_path / "train.jsonl", n=64, seed=5)
    out = tmp_path / "run"
    cmd = train_cmd(toy_target, vllm_python, mlflow_server.uri, data, out, "verifier-never-starts",
                    "verifier.extra_args=[--enforce-eager, --no-such-vllm-flag]")
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode != 0
    line = last_error(res.stderr)
    assert "its verifier failed to start" in line and "no checkpoint yet" in line, line
    assert "the verifier did not start" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.slow
def test_a_killed_trainer_rank_is_named_in_one_line(toy_target, tmp_path):
    data = write_toy_conversations(tmp_path / "train.jsonl", n=64, seed=6)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "hpc", "train", "configs/toy-cpu.yaml", f"verifier.model={toy_target}",
           "verifier.backend=hf", f"data.sources=[{{path: {data}}}]", f"train.output_dir={out}",
           "train.checkpoint_interval=5", "stream.peer_timeout_s=8", "tracking.uri=sqlite:///" + str(tmp_path / "m.db"),
           "--steps", "200"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    poll(lambda: proc.poll() is not None or progress_step(out) >= 3, bool, 300, 0.2)
    # The rank processes, in start order (rank 0, 1, ...): multiprocessing's spawn children.
    ranks = sorted((c for c in psutil.Process(proc.pid).children() if is_rank(c)), key=lambda c: c.create_time())
    ranks[1].kill()  # trainer rank 1, as the OOM killer would
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode != 0
    line = last_error(stderr)
    assert "rank 1 (trainer 1) was killed by SIGKILL" in line, line
    assert "Traceback" not in stderr, stderr[-3000:]
