"""The plain `sbatch/*.sbatch` scripts, submitted by hand to the real local Slurm cluster:
training on a 1 verifier + 1 trainer node allocation, the node-count guard, and an eval of the
trained export. No `dspark submit` in the loop: exactly what a user types.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from hpc_dev.toy_data import write_toy_conversations
from tests.fixtures.slurm import SlurmCluster
from tests.fixtures.wait import poll

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "configs/toy-cpu.yaml"
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED",
            "BOOT_FAIL", "DEADLINE"}
# toy-cpu.yaml warms up for 10 steps, which validation rejects for a 4-step run.
TRAIN_OVERRIDES = ["train.steps=4", "train.warmup_steps=1", "train.checkpoint_interval=2"]

pytestmark = pytest.mark.slow


@dataclass
class Job:
    id: str
    state: str
    exit_code: str  # sacct's "code:signal"
    elapsed_s: int
    log: str


def sbatch(script: str, sbatch_args: list[str], script_args: list[str], log: Path, timeout_s: float,
           export: str = "") -> Job:
    """Submit from the repo root as a user would, then wait for sacct's final word."""
    cmd = ["sbatch", "--parsable", f"--output={log}", f"--export=ALL,DSPARK_PYTHON={sys.executable}{export}",
           *sbatch_args, f"sbatch/{script}", *script_args]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, f"sbatch refused {script}: {res.stderr.strip()}"
    return wait(res.stdout.strip().split(";")[0], log, timeout_s)


def wait(job_id: str, log: Path, timeout_s: float) -> Job:
    def sacct() -> list[str]:
        # sacct, not squeue: a finished job leaves squeue at once, and only sacct says how it ended.
        rows = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode,ElapsedRaw"],
                              capture_output=True, text=True, timeout=30).stdout.splitlines()
        return rows[0].strip().split("|") if rows else []

    def state(fields: list[str]) -> str:
        return fields[0].split()[0] if fields and fields[0] else ""  # "CANCELLED by 0" -> CANCELLED

    fields = poll(sacct, lambda f: state(f) in TERMINAL, timeout_s, 1.0)
    if state(fields) in TERMINAL:
        text = log.read_text(errors="replace") if log.exists() else ""
        return Job(job_id, state(fields), fields[1], int(fields[2] or 0), text)
    subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    tail = log.read_text(errors="replace")[-4000:] if log.exists() else "(no log)"
    raise AssertionError(f"job {job_id} not finished within {timeout_s:.0f} s ({fields}); cancelled\n{tail}")


def steps(job_id: str) -> dict[str, tuple[str, int]]:
    """Each srun step of a job: (state, node count)."""
    out = subprocess.run(["sacct", "-n", "-P", "-j", job_id, "-o", "JobID,State,NNodes"],
                         capture_output=True, text=True, timeout=30).stdout
    rows = [line.split("|") for line in out.splitlines() if "|" in line]
    return {r[0].split(".", 1)[1]: (r[1], int(r[2])) for r in rows if re.fullmatch(r"\d+\.\d+", r[0])}


def common_overrides(cluster: SlurmCluster, toy_target: Path, tmp: Path) -> list[str]:
    # The eval needs the training job's keys (train.output_dir above all) to find its export.
    write_toy_conversations(tmp / "train.jsonl", n=32, seed=1)  # validation wants the file to exist
    return [f"verifier.model={toy_target}", "verifier.backend=hf", f"cluster.partition={cluster.partition}",
            f"train.output_dir={tmp / 'train'}", f"data.sources=[{{path: {tmp / 'train.jsonl'}}}]",
            # A regenerated set left in the repo's runs/data would otherwise replace our sources.
            f"data.output_dir={tmp / 'data'}", f"tracking.uri=sqlite:///{tmp / 'mlflow.db'}"]


@dataclass
class Trained:
    tmp: Path
    overrides: list[str]
    job: Job


@pytest.fixture(scope="module")
def trained(slurm_cluster: SlurmCluster, toy_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Trained:
    """One training job for the train and eval tests: it is the slow part."""
    tmp = tmp_path_factory.mktemp("sbatch")
    overrides = common_overrides(slurm_cluster, toy_target, tmp)
    job = sbatch("train.sbatch", ["--nodes=2", f"--partition={slurm_cluster.partition}", "--time=00:15:00"],
                 [CONFIG, *overrides, *TRAIN_OVERRIDES], tmp / "train.log", timeout_s=480)
    return Trained(tmp, overrides, job)


def test_train_with_the_wrong_node_count_fails_fast_with_one_line(
    slurm_cluster: SlurmCluster, toy_target: Path, tmp_path: Path
) -> None:
    overrides = common_overrides(slurm_cluster, toy_target, tmp_path)
    job = sbatch("train.sbatch", ["--nodes=1", f"--partition={slurm_cluster.partition}", "--time=00:10:00"],
                 [CONFIG, *overrides, *TRAIN_OVERRIDES], tmp_path / "train.log", timeout_s=120)
    assert (job.state, job.exit_code) == ("FAILED", "2:0"), f"{job}\n{job.log[-4000:]}"
    expected = ("error: allocation has 1 node(s) but configs/toy-cpu.yaml needs cluster.verifier_nodes + "
                "cluster.trainer_nodes = 1 + 1 = 2; resubmit with sbatch --nodes=2")
    errors = [line for line in job.log.splitlines() if line.startswith("error:")]
    assert errors == [expected], job.log
    assert "Traceback" not in job.log
    # Nothing was launched: no srun step, no output directory.
    assert steps(job.id) == {}
    assert not (tmp_path / "train").exists()
    assert job.elapsed_s < 60, job


def test_train_on_one_verifier_and_one_trainer_node(trained: Trained) -> None:
    job = trained.job
    assert (job.state, job.exit_code) == ("COMPLETED", "0:0"), f"{job}\n{job.log[-4000:]}"
    out = trained.tmp / "train"
    assert (out / "checkpoints" / "step_00000004").is_dir(), sorted(p.name for p in (out / "checkpoints").iterdir())
    assert (out / "export" / "model.safetensors").is_file()
    # One srun task per node, each taking its role from its node index.
    roles = re.findall(r"^node (\d+) \((verifier|trainer)\): ranks (\[[\d, ]*\])", job.log, re.M)
    assert sorted(roles) == [("0", "verifier", "[2]"), ("1", "trainer", "[0, 1]")], job.log[-4000:]
    assert steps(job.id) == {"0": ("COMPLETED", 2)}  # the whole training is one srun over both nodes


def test_calibrate_fits_the_held_out_rows_into_the_export(slurm_cluster: SlurmCluster, trained: Trained) -> None:
    assert trained.job.state == "COMPLETED", "the training job failed: see test_train_on_one_verifier_and_one_trainer_node"
    tmp = trained.tmp
    job = sbatch("calibrate.sbatch", [f"--partition={slurm_cluster.partition}", "--time=00:10:00"],
                 [CONFIG, *trained.overrides], tmp / "calibrate.log", timeout_s=300)
    assert (job.state, job.exit_code) == ("COMPLETED", "0:0"), f"{job}\n{job.log[-4000:]}"
    assert "dspark stage all: calibrate\n" in job.log  # the table's stage, alone (--only calibrate)
    # configs/toy-cpu.yaml holds every 10th row out: ids 9, 19 and 29 of the 32.
    assert "fitted on 3 held-out rows" in job.log, job.log[-4000:]
    assert (tmp / "train" / "export" / "confidence_calibration.json").is_file()
    assert steps(job.id) == {"0": ("COMPLETED", 1)}


def test_eval_of_the_trained_export_at_n3(slurm_cluster: SlurmCluster, trained: Trained) -> None:
    assert trained.job.state == "COMPLETED", "the training job failed: see test_train_on_one_verifier_and_one_trainer_node"
    tmp = trained.tmp
    evals = ["eval.engine=reference", "eval.fixtures=true", "eval.rows=1", "eval.max_tokens=16",
             "eval.code_max_tokens=16", "eval.compare=[]", f"eval.output_dir={tmp / 'eval'}",
             "eval.benchmarks=[gsm8k,humaneval]", "eval.timing_min_pairs=2"]
    job = sbatch("eval.sbatch", [f"--partition={slurm_cluster.partition}", "--time=00:10:00"],
                 [CONFIG, *trained.overrides, *evals], tmp / "eval.log", timeout_s=420, export=",N=3")
    assert (job.state, job.exit_code) == ("COMPLETED", "0:0"), f"{job}\n{job.log[-4000:]}"
    assert "dspark stage all: eval-n3\n" in job.log and "dspark stage all: eval-n3 exited 0" in job.log
    runs = list((tmp / "eval").glob("eval-n3-DSpark-*"))  # suffixed with the draft's content hash
    assert len(runs) == 1, sorted(map(str, (tmp / "eval").rglob("*")))
    assert (runs[0] / "gsm8k.json").is_file() and (runs[0] / "humaneval.json").is_file()
    assert steps(job.id) == {"0": ("COMPLETED", 1)}
