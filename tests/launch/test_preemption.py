"""Preemption on the real local cluster: a training allocation gets USR2 mid-run, every rank
checkpoints, node 0 requeues the job, and the requeued job finishes with a loss curve
bit-identical to an uninterrupted run of the same recipe."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_dev.toy_data import write_toy_conversations
from tests.fixtures.wait import wait_until

ROOT = Path(__file__).resolve().parents[2]
# Long enough that the signal lands mid-run: progress.json is written every ~2 s, and on this
# machine 40 steps took ~3 s, so the signal came after the last step.
STEPS = 200


def recipe(toy_target: Path, tmp: Path, partition: str) -> list[str]:
    # One trainer rank fed by one streamer: the sample order is fixed, so losses can match bit for bit.
    data = write_toy_conversations(tmp / "train.jsonl", n=48, seed=1)
    return [f"verifier.model={toy_target}", "verifier.backend=hf", f"data.sources=[{{path: {data}}}]",
            "data.regenerate=false", f"cluster.partition={partition}", "train.ranks_per_node=1",
            "train.global_batch_size=2", "train.grad_accumulation=1", f"train.steps={STEPS}",
            "train.warmup_steps=2", "train.checkpoint_interval=1000", "train.keep_checkpoints=3",
            f"tracking.uri=sqlite:///{tmp}/mlflow.db"]


def losses(train_dir: Path) -> list[float]:
    last = sorted((train_dir / "checkpoints").glob("step_*"))[-1]
    return json.loads((last / "state.json").read_text())["losses"]


def sacct_state(job: str) -> str:
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job, "-o", "State"], capture_output=True,
                         text=True).stdout.split()
    return out[0] if out else "UNKNOWN"


@pytest.mark.slow
def test_usr2_checkpoints_requeues_and_the_loss_curve_continues_exactly(slurm_cluster, toy_target, tmp_path):
    base = recipe(toy_target, tmp_path, slurm_cluster.partition)
    ref = subprocess.run([sys.executable, "-m", "hpc", "train", "configs/toy-cpu.yaml", *base,
                          f"train.output_dir={tmp_path / 'ref'}"], capture_output=True, text=True, cwd=ROOT,
                         timeout=900)
    assert ref.returncode == 0, ref.stdout[-2000:] + ref.stderr[-2000:]
    expected = losses(tmp_path / "ref")
    assert len(expected) == STEPS

    job_dir, log = tmp_path / "job", tmp_path / "train.log"
    job = subprocess.run(["sbatch", "--parsable", "--nodes=2", f"--partition={slurm_cluster.partition}",
                          f"--output={log}", f"--export=ALL,DSPARK_PYTHON={sys.executable}",
                          "sbatch/train.sbatch", "configs/toy-cpu.yaml", *base, f"train.output_dir={job_dir}"],
                         capture_output=True, text=True, cwd=ROOT, check=True).stdout.strip().split(";")[0]
    try:
        progress = job_dir / "progress.json"

        def past_step_3() -> bool:
            if progress.exists() and json.loads(progress.read_text())["step"] >= 3:
                return True
            assert sacct_state(job) in ("PENDING", "RUNNING", "UNKNOWN"), log.read_text()[-3000:]
            return False

        wait_until(past_step_3, 600, 0.5, lambda: log.read_text()[-3000:] if log.exists() else "no log")
        # What Slurm does 90 s before a preemption or the time limit (--signal=USR2@90).
        subprocess.run(["scancel", "--signal=USR2", job], check=True)

        def completed() -> bool:
            state = sacct_state(job)
            assert state not in ("FAILED", "CANCELLED", "TIMEOUT"), log.read_text()[-4000:]
            return state == "COMPLETED"

        wait_until(completed, 900, 2, lambda: log.read_text()[-4000:])
    finally:
        subprocess.run(["scancel", job], capture_output=True)
    text = log.read_text()
    assert "checkpointed; requeued" in text and "attempt 2" in text, text[-4000:]
    steps = sorted(int(p.name.split("_")[1]) for p in (job_dir / "checkpoints").glob("step_*"))
    assert steps[-1] == STEPS and 3 <= steps[0] < STEPS  # the preemption checkpoint, then the end
    assert losses(job_dir) == expected  # bit-identical across the requeue
    check_drill_record(job_dir, text, base + [f"train.output_dir={job_dir}"])


def check_drill_record(job_dir: Path, log_text: str, overrides: list[str]) -> None:
    """The drill: node 0 measured each part of the window on this cluster, its ranks on the other
    node included, and put the plan's model for the same config beside each (issue 45, item 3)."""
    from hpc.launch.launch_checks import resolve
    from hpc.launch.preemption import PARTS, RECORD, modelled_window, window_line

    rec = json.loads((job_dir / RECORD).read_text())
    assert (job_dir / RECORD).stat().st_mode & 0o077 == 0
    assert rec["attempt"] == 0 and rec["signal_delay_s"] == 90
    by = {p["part"]: p for p in rec["parts"]}
    assert list(by) == list(PARTS)
    for part in PARTS:  # every part measured on this run, none made up
        assert by[part]["measured_s"] is not None and 0 <= by[part]["measured_s"] < 600, by[part]
    ckpt = by["write the checkpoint"]
    assert ckpt["bytes"] > 0 and abs(ckpt["gbytes_s"] - ckpt["bytes"] / 1e9 / ckpt["measured_s"]) < 1e-9
    assert by["vLLM shutdown"]["backend"] == "hf"  # this drill's verifier: in-process, nothing to stop
    # the whole window, signal to requeue, holds every part that runs in turn after the step boundary
    assert rec["signal_to_requeue_s"] >= by["write the checkpoint"]["measured_s"] + by["requeue"]["measured_s"]
    model = modelled_window(resolve(str(ROOT / "configs/toy-cpu.yaml"), overrides, check_tracking=False))
    assert model and all(by[part]["modelled_s"] == model[part][0] for part in PARTS)
    # node 0's line at the requeue can go with the step Slurm ends; the next attempt prints it from the record
    line = window_line(rec, 90, job_dir / RECORD)
    assert line.startswith("preemption window (attempt 0): reach a step boundary "
                           f"{by['reach a step boundary']['measured_s']:.2f} s")
    assert f"dspark stage all: the last attempt's {line}" in log_text, log_text[-3000:]


def test_the_next_attempt_prints_only_its_predecessors_record(toy_target, tmp_path):
    """The requeued job's log gets the window from disk: the record of the attempt just before,
    never an older job's, nor a broken file."""
    from hpc.launch.launch_checks import resolve
    from hpc.launch.preemption import RECORD, last_window

    cfg = resolve(str(ROOT / "configs/toy-cpu.yaml"), [*recipe(toy_target, tmp_path, "debug"),
                                                          f"train.output_dir={tmp_path}"], check_tracking=False)
    assert last_window(cfg, 1) is None  # no record
    part = {"part": "reach a step boundary", "measured_s": 0.25}
    (tmp_path / RECORD).write_text(json.dumps({"attempt": 0, "signal_to_requeue_s": 1.5, "parts": [part]}))
    line = last_window(cfg, 1)
    assert line and line.startswith("preemption window (attempt 0): reach a step boundary 0.25 s; "
                                    "signal to requeue 1.5 s")
    assert last_window(cfg, 0) is None and last_window(cfg, 2) is None  # first attempt; an older attempt's
    (tmp_path / RECORD).write_text("{not json")
    assert last_window(cfg, 1) is None
