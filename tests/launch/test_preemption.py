"""Preemption on the real local cluster: a shared verifier's training allocation (one verifier
node, a trainer node per variant of a 2-lr sweep) gets USR2 mid-run, every variant's ranks
checkpoint, node 0 requeues the job, and the requeued job finishes each variant with a loss curve
bit-identical to an uninterrupted run of the same sweep."""

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
SWEEP = "sweep={train.lr: [0.001, 0.0005]}"


def recipe(toy_target: Path, tmp: Path, partition: str) -> list[str]:
    # One trainer rank per variant fed by one streamer: the sample order is fixed, so losses can match bit for bit.
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


def step_of(train_dir: Path) -> int:
    progress = train_dir / "progress.json"
    return json.loads(progress.read_text())["step"] if progress.exists() else 0


@pytest.mark.slow
def test_usr2_requeues_a_shared_verifier_and_every_variant_continues_exactly(slurm_cluster, toy_target, tmp_path):
    base = [*recipe(toy_target, tmp_path, slurm_cluster.partition), SWEEP]
    ref = subprocess.run([sys.executable, "-m", "hpc", "train", "configs/toy-cpu.yaml", *base, "--share-verifier",
                          f"train.output_dir={tmp_path / 'ref'}"], capture_output=True, text=True, cwd=ROOT,
                         timeout=900)
    assert ref.returncode == 0, ref.stdout[-2000:] + ref.stderr[-2000:]
    expected = [losses(tmp_path / "ref" / f"v{i}") for i in range(2)]
    assert [len(e) for e in expected] == [STEPS, STEPS] and expected[0] != expected[1]

    # The pipeline as a user submits it; only its train job matters here, so the rest is cancelled.
    res = subprocess.run([sys.executable, "-m", "hpc", "submit", "configs/toy-cpu.yaml", *base,
                          "submit.share_verifier=true", f"train.output_dir={tmp_path / 'job'}",
                          f"cluster.log_dir={tmp_path / 'slurm'}", "tracking.allow_file_store=true"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    [state] = (tmp_path / "slurm" / "pipelines").glob("*/pipeline.json")
    pipeline = json.loads(state.read_text())
    job = pipeline["jobs"]["train"]
    others = [j for name, j in pipeline["jobs"].items() if name != "train"]
    subprocess.run(["scancel", *others], check=True)
    dirs = [Path(d) for d in pipeline["train_dirs"]]
    logs = tmp_path / "slurm"

    def log_tail() -> str:
        return "\n".join(p.read_text(errors="replace")[-2500:] for p in sorted(logs.rglob(f"{job}_*_log.*")))
    try:
        def every_variant_past_step_3() -> bool:
            if all(step_of(d) >= 3 for d in dirs):
                return True
            assert sacct_state(job) in ("PENDING", "RUNNING", "UNKNOWN"), log_tail()
            return False

        wait_until(every_variant_past_step_3, 600, 0.5, log_tail)
        # What Slurm does 90 s before a preemption or the time limit (--signal=USR2@90).
        subprocess.run(["scancel", "--signal=USR2", job], check=True)

        def completed() -> bool:
            state = sacct_state(job)
            assert state not in ("FAILED", "CANCELLED", "TIMEOUT"), log_tail()
            return state == "COMPLETED"

        wait_until(completed, 900, 2, log_tail)
    finally:
        subprocess.run(["scancel", job], capture_output=True)
    for d, want in zip(dirs, expected, strict=True):
        steps = sorted(int(p.name.split("_")[1]) for p in (d / "checkpoints").glob("step_*"))
        assert steps[-1] == STEPS and 3 <= steps[0] < STEPS, (d, steps)  # the preemption checkpoint, then the end
        assert losses(d) == want, d  # bit-identical across the requeue, each variant
    check_drill_record(dirs, log_tail(), [*base, f"train.output_dir={dirs[0]}"])


def check_drill_record(job_dirs: list[Path], log_text: str, overrides: list[str]) -> None:
    """The drill: node 0 measured each part of the window on this cluster, the ranks on the other
    nodes included, every variant's trainers (each marks in its own directory) the slowest of
    them, and put the plan's model for the same config beside each (issue 45, item 3)."""
    from hpc.launch.launch_checks import resolve
    from hpc.launch.preemption import PARTS, RECORD, modelled_window, window_line
    from hpc.train.preempt_clock import MARKS, REQUEUE

    job_dir = job_dirs[0]
    rec = json.loads((job_dir / RECORD).read_text())
    assert (job_dir / RECORD).stat().st_mode & 0o077 == 0
    assert rec["attempt"] == 0 and rec["signal_delay_s"] == 90
    by = {p["part"]: p for p in rec["parts"]}
    assert list(by) == list(PARTS)
    for part in PARTS:  # every part measured on this run, none made up
        assert by[part]["measured_s"] is not None and 0 <= by[part]["measured_s"] < 600, by[part]
    marks = [m for d in job_dirs for line in (d / MARKS).read_text().splitlines()
             if (m := json.loads(line))["attempt"] == 0]
    assert {m["rank"] for m in marks if m["part"] == "write the checkpoint"} == set(range(len(job_dirs)))
    for part in set(PARTS) - {REQUEUE}:  # node 0's own; the rest the slowest rank's, whichever variant's
        assert by[part]["measured_s"] == max(m["s"] for m in marks if m["part"] == part), part
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
    assert f"node 0 (verifier): attempt 2; the last attempt's {line}" in log_text, log_text[-3000:]


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


def test_a_second_term_during_the_records_write_leaves_it_whole(tmp_path):
    """Slurm ends a requeued job's step with TERM twice (slurmstepd's, then srun's): the second,
    landing while node 0 writes the record from the first, used to exit mid-write and leave only
    a temporary file. In a child process: the handler ends it with os._exit."""
    from hpc.launch.preemption import RECORD

    code = ("import os, signal, sys\n"
            "from hpc.config.schema import DSparkConfig\n"
            "from hpc.launch import preemption\n"
            "cfg = DSparkConfig()\n"
            "cfg.train.output_dir = sys.argv[1]\n"
            "real = preemption.write_text\n"
            "def second_term(path, text, **kw):\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    real(path, text, **kw)\n"
            "preemption.write_text = second_term\n"
            "preemption.requeue_timed(cfg, lambda: os.kill(os.getpid(), signal.SIGTERM), 75)\n"
            "print('the first TERM did not end the job')\n")
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert res.returncode == 75, res.stdout + res.stderr
    assert "did not end" not in res.stdout and "to Slurm's TERM that ended the job" in (tmp_path / RECORD).read_text()
    assert json.loads((tmp_path / RECORD).read_text())["attempt"] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [RECORD], "a torn temporary file was left"
