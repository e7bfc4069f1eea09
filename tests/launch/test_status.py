"""`dspark status` / `dspark cancel` (hpc/launch/status.py).

The first test runs real jobs on the dev cluster (`slurm_cluster`); the rest fake
`subprocess.run` or need no Slurm at all.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hpc import cli
from hpc.errors import UserError
from hpc.launch import status as st
from hpc.launch.status import JobState, cancel, expand_array_id, find_pipeline, job_states, status
from tests.fixtures.slurm import SlurmCluster
from tests.fixtures.wait import poll


def _write_pipeline(root: Path, pid: str, jobs: dict[str, str], train_dirs: list[str], *,
                    uri: str = "sqlite:////tmp/mlflow.db", submitted: str = "2026-11-29T22:15:00") -> Path:
    state = {"pipeline": pid, "config": "/abs/configs/toy-cpu.yaml", "overrides": [],
             "parent_run_id": "abc123", "tracking_uri": uri, "experiment": "toy-cpu-dspark",
             "jobs": jobs, "variants": [], "train_dirs": train_dirs, "submitted": submitted}
    path = root / "pipelines" / pid / "pipeline.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(state))
    return path


def _progress(train_dir: Path, updated: float, step: int = 40) -> None:
    train_dir.mkdir(parents=True, exist_ok=True)
    (train_dir / "progress.json").write_text(json.dumps(
        {"step": step, "total": 100, "loss": 0.81, "samples_per_s": 5.1, "eta_s": 93.0, "updated": updated}))


# ---- against the real dev cluster ---------------------------------------------------------


def _sbatch(partition: str, *args: str) -> str:
    # No --output: Slurm would write slurm-%j.out into the working directory (the checkout).
    res = subprocess.run(["sbatch", "--parsable", "-p", partition, "-t", "5", "-o", "/dev/null", *args,
                          "--wrap", "sleep 60"],
                         capture_output=True, text=True, timeout=30, check=True)
    return res.stdout.strip().split(";")[0]


def _poll(ids: list[str], done, timeout_s: float = 20.0) -> dict[str, JobState]:
    return poll(lambda: job_states(ids), done, timeout_s, 1.0)


@pytest.mark.timeout(120, func_only=True)
def test_status_and_cancel_real_jobs(slurm_cluster: SlurmCluster, tmp_path: Path, capsys, monkeypatch) -> None:
    part = slurm_cluster.partition
    ids: list[str] = []
    try:
        ids.append(_sbatch(part, "-J", "st-regen"))
        ids.append(_sbatch(part, "-J", "st-train", "--array=0-1"))
        # Held back by a dependency, so it is PENDING whatever the cluster's load.
        ids.append(_sbatch(part, "-J", "st-report", f"--dependency=afterok:{ids[1]}"))
        _progress(tmp_path / "v0" / "train", time.time())
        pf = _write_pipeline(tmp_path, "toy-real", dict(zip(["regenerate", "train", "report"], ids)),
                             [str(tmp_path / "v0" / "train"), str(tmp_path / "v1" / "train")])

        want = {ids[0], f"{ids[1]}_0", f"{ids[1]}_1"}
        states = _poll(ids, lambda s: all(s.get(k) and s[k].state == "RUNNING" for k in want), 40.0)
        assert {k: states[k].state for k in want} == dict.fromkeys(want, "RUNNING"), states
        assert states[ids[2]].state == "PENDING"

        text = status(pf)
        lines = text.splitlines()
        train0 = next(ln for ln in lines if f"{ids[1]}_0" in ln)
        assert "RUNNING" in train0 and "v0" in train0
        assert "40/100 loss 0.810 5.1 samples/s ETA 1m33s" in train0
        assert "updated" not in train0  # fresh progress carries no age
        assert "RUNNING" in next(ln for ln in lines if f"{ids[1]}_1" in ln)
        assert "PENDING" in next(ln for ln in lines if ln.lstrip().startswith("report"))
        assert "mlflow ui --backend-store-uri sqlite:////tmp/mlflow.db" in text and "abc123" in text
        assert lines[-1] == "3 running, 1 pending"

        assert cancel(pf) == ids
        assert "cancelled pipeline toy-real" in capsys.readouterr().out
        states = _poll(ids, lambda s: len(s) == 4 and all(j.state == "CANCELLED" for j in s.values()))
        assert {j.state for j in states.values()} == {"CANCELLED"}, states
        assert len(states) == 4
        # Cancelling ended jobs again is harmless.
        assert cancel(pf) == ids
    finally:
        if ids:
            subprocess.run(["scancel", *ids], capture_output=True, timeout=30, check=False)


# ---- faked subprocess.run -----------------------------------------------------------------

SACCT_OUT = """\
11|toy-regenerate|COMPLETED|00:02:10|0:0|node1
12_0|toy-train|RUNNING|00:01:00|0:0|node[1-2]
12_1|toy-train|FAILED|00:00:30|1:0|node3
13_[0-1]|toy-eval-n3|PENDING|00:00:00|0:0|None assigned
14_0|toy-eval-n7|CANCELLED by 0|00:00:00|0:0|None assigned
"""


class FakeRun:
    def __init__(self, stdout: str = "", stderr: str = "", rc: int = 0, missing: bool = False):
        self.stdout, self.stderr, self.rc, self.missing = stdout, stderr, rc, missing
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        self.calls.append(list(argv))
        if self.missing:
            raise FileNotFoundError(2, "No such file or directory", argv[0])
        return subprocess.CompletedProcess(argv, self.rc, self.stdout, self.stderr)


def test_sacct_missing_is_one_line(monkeypatch) -> None:
    monkeypatch.setattr(subprocess, "run", FakeRun(missing=True))
    with pytest.raises(UserError) as err:
        job_states(["12", "13"])
    msg = str(err.value)
    assert "\n" not in msg and "sacct not found" in msg and "squeue -j 12,13" in msg


def test_sacct_failing_names_accounting(monkeypatch) -> None:
    monkeypatch.setattr(subprocess, "run", FakeRun(stderr="sacct: error: Slurm accounting storage is disabled\n",
                                                   rc=1))
    with pytest.raises(UserError) as err:
        job_states(["12"])
    msg = str(err.value)
    assert "\n" not in msg and "accounting storage is disabled" in msg
    assert "accounting (slurmdbd) enabled" in msg and "squeue" in msg


def test_table_from_parsed_sacct(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("COLUMNS", "80")  # a narrow terminal cuts nothing: no job id, state or progress
    fake = FakeRun(stdout=SACCT_OUT)
    monkeypatch.setattr(subprocess, "run", fake)
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now)  # the age below is exact, however slow this machine
    _progress(tmp_path / "v0" / "train", now - 300)  # a stale file says how old it is
    (tmp_path / "v1" / "train" / "logs").mkdir(parents=True)  # v1 failed on an NCCL timeout: two ranks dumped
    for r in (0, 1):
        (tmp_path / "v1" / "train" / "logs" / f"nccl-trace-rank{r}").write_bytes(b"\x80")
    jobs = {"regenerate": "11", "train": "12", "eval-n3": "13", "eval-n7": "14", "report": "15"}
    pf = _write_pipeline(tmp_path, "toy", jobs, [str(tmp_path / "v0" / "train"), str(tmp_path / "v1" / "train")])

    text = status(pf)
    assert len(fake.calls) == 1 and fake.calls[0][:6] == ["sacct", "-X", "-n", "-P", "-j", "11,12,13,14,15"]
    rows = {ln.split()[1]: ln for ln in text.splitlines() if len(ln.split()) > 3 and ln.split()[0] in jobs}
    assert set(rows) == {"11", "12_0", "12_1", "13_0", "13_1", "14_0", "15"}
    assert "COMPLETED" in rows["11"] and "0:0" in rows["11"] and "node1" in rows["11"]
    assert "RUNNING" in rows["12_0"] and "node[1-2]" in rows["12_0"]
    assert "40/100 loss 0.810 5.1 samples/s ETA 1m33s (updated 5m00s ago)" in rows["12_0"]
    assert "FAILED" in rows["12_1"] and "1:0" in rows["12_1"]
    assert f"flight recorder dumps {tmp_path / 'v1' / 'train' / 'logs'}/nccl-trace-rank* (2 ranks)" in rows["12_1"]
    assert "flight recorder" not in rows["12_0"]
    assert "PENDING" in rows["13_0"] and "PENDING" in rows["13_1"] and "v1" in rows["13_1"]
    assert "CANCELLED" in rows["14_0"] and "by 0" not in rows["14_0"]
    assert "UNKNOWN" in rows["15"] and "not in sacct yet" in rows["15"]
    assert "toy" in text.splitlines()[0] and "2026-11-29T22:15:00" in text.splitlines()[0]
    assert text.splitlines()[-1] == "1 completed, 1 running, 2 pending, 1 failed, 1 cancelled, 1 unknown"


def test_a_shared_verifiers_one_train_job_shows_a_row_per_variant(monkeypatch, tmp_path: Path) -> None:
    fake = FakeRun(stdout="12|toy-train|RUNNING|00:01:00|0:0|node[1-3]\n")
    monkeypatch.setattr(subprocess, "run", fake)
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now)
    _progress(tmp_path / "v0" / "train", now, step=40)
    _progress(tmp_path / "v1" / "train", now, step=25)
    pf = _write_pipeline(tmp_path, "toy", {"train": "12"}, [str(tmp_path / f"v{i}" / "train") for i in (0, 1)])
    state = json.loads(pf.read_text())
    pf.write_text(json.dumps({**state, "shared_verifier": True}))
    rows = [ln.split() for ln in status(pf).splitlines() if ln.startswith("train ")]
    # one job, both drafts: each row names its variant and shows that draft's own progress
    assert [(r[1], r[2], r[3], r[7]) for r in rows] == [("12", "v0", "RUNNING", "40/100"), ("12", "v1", "RUNNING", "25/100")]
    # the ablations (or a named sweep): each row also carries the draft's name on the card
    pf.write_text(json.dumps({**state, "shared_verifier": True, "labels": ["DSpark", "Markov-only"]}))
    rows = [ln.split() for ln in status(pf).splitlines() if ln.startswith("train ")]
    assert [(r[2], r[3], r[4]) for r in rows] == [("v0", "DSpark", "RUNNING"), ("v1", "Markov-only", "RUNNING")]
    # One draft failed alone (its launcher wrote why): its row says so, the other trains on.
    from hpc.formats import draft_failure

    draft_failure.record(tmp_path / "v1" / "train", "Markov-only", "training stopped at step 25 of 100: loss nan")
    text = status(pf)
    rows = [ln for ln in text.splitlines() if ln.startswith("train ")]
    assert "RUNNING" in rows[0] and "FAILED" not in rows[0]
    assert "FAILED" in rows[1] and "this draft failed: training stopped at step 25 of 100: loss nan" in rows[1]
    assert text.splitlines()[-1] == "1 running, 1 failed"


def test_expand_pending_array_ids() -> None:
    assert expand_array_id("12_[0-1]") == ["12_0", "12_1"]
    assert expand_array_id("12_[0,3-4%2]") == ["12_0", "12_3", "12_4"]
    assert expand_array_id("12_[0-6:3]") == ["12_0", "12_3", "12_6"]
    assert expand_array_id("12_3") == ["12_3"] and expand_array_id("12") == ["12"]
    assert expand_array_id("12_[x]") == ["12_[x]"]  # not understood: shown as sacct said


def test_cancel_one_scancel_and_finished_jobs_are_fine(monkeypatch, tmp_path: Path, capsys) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/m.db"
    client = MlflowClient(uri)
    parent = client.create_run(client.create_experiment("toy")).info.run_id
    fake = FakeRun(rc=1, stderr="scancel: error: Kill job error on job id 11: "
                                "Job/step already completing or completed\n")
    monkeypatch.setattr(subprocess, "run", fake)
    pf = _write_pipeline(tmp_path, "toy", {"regenerate": "11", "train": "12", "report": "15"}, [], uri=uri)
    state = json.loads(pf.read_text())
    pf.write_text(json.dumps({**state, "parent_run_id": parent}))
    assert cancel(pf) == ["11", "12", "15"]
    assert fake.calls == [["scancel", "11", "12", "15"]]
    assert "cancelled pipeline toy: regenerate 11, train 12, report 15" in capsys.readouterr().out
    # The report job would have ended the pipeline's run; it is cancelled too, so cancel ends it.
    run = client.get_run(parent)
    assert run.info.status == "KILLED" and run.data.tags["dspark.outcome"] == "cancelled with `dspark cancel`"
    # A pipeline that had already ended keeps its outcome.
    done = client.create_run(run.info.experiment_id).info.run_id
    client.set_terminated(done, "FINISHED")
    pf.write_text(json.dumps({**state, "parent_run_id": done}))
    cancel(pf)
    assert client.get_run(done).info.status == "FINISHED"


def test_cancel_without_scancel_fails_clearly(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(subprocess, "run", FakeRun(missing=True))
    pf = _write_pipeline(tmp_path, "toy", {"train": "12", "report": "15"}, [])
    with pytest.raises(UserError, match=r"scancel not found; cancel them by hand: scancel 12 15"):
        cancel(pf)


# ---- MLflow link --------------------------------------------------------------------------


def test_mlflow_link_with_a_live_server(monkeypatch) -> None:
    import mlflow.tracking

    class Client:
        def __init__(self, uri: str):
            assert uri == "http://mlflow.example:5000/"

        def get_experiment_by_name(self, name: str):
            return SimpleNamespace(experiment_id="7") if name == "toy-cpu-dspark" else None

    monkeypatch.setattr(mlflow.tracking, "MlflowClient", Client)
    state = {"tracking_uri": "http://mlflow.example:5000/", "experiment": "toy-cpu-dspark", "parent_run_id": "abc"}
    assert st.mlflow_link(state) == "mlflow: http://mlflow.example:5000/#/experiments/7/runs/abc"


def test_mlflow_link_with_a_dead_server_is_quick() -> None:
    from hpc.net import free_port

    uri = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    line = st.mlflow_link({"tracking_uri": uri, "experiment": "x", "parent_run_id": "abc"})
    assert time.monotonic() - start < 15
    assert line == f"mlflow: run abc at {uri} (could not look up the experiment: connection refused)"


# ---- finding the pipeline -----------------------------------------------------------------


def test_find_pipeline(tmp_path: Path, monkeypatch) -> None:
    log_dir = tmp_path / "runs" / "slurm"
    old = _write_pipeline(log_dir, "toy-20261129-221500", {"train": "1"}, [], submitted="2026-11-29T22:15:00")
    new = _write_pipeline(log_dir, "toy-20261130-080000", {"train": "2"}, [], submitted="2026-11-30T08:00:00")
    (log_dir / "pipelines" / "toy-broken").mkdir()
    ld = str(log_dir)
    assert find_pipeline(str(old), ld) == old
    assert find_pipeline(str(old.parent), ld) == old
    assert find_pipeline("toy-20261129-221500", ld) == log_dir / "pipelines" / "toy-20261129-221500" / "pipeline.json"
    assert find_pipeline("toy-20261130", ld).parent.name == new.parent.name  # a unique prefix
    assert find_pipeline("latest", ld).parent.name == new.parent.name
    monkeypatch.chdir(tmp_path)  # the default log_dir is relative, as cluster.log_dir is
    assert find_pipeline("latest") == Path("runs/slurm/pipelines/toy-20261130-080000/pipeline.json")

    with pytest.raises(UserError, match=r"no pipeline 'nope' under .*: pass a pipeline id \(`ls .*pipelines`\)"):
        find_pipeline("nope", ld)
    with pytest.raises(UserError, match="matches 2 pipelines"):
        find_pipeline("toy-2026", ld)
    with pytest.raises(UserError, match="has no pipeline.json"):
        find_pipeline("toy-broken", ld)
    with pytest.raises(UserError, match="no pipeline of yours under .*dspark submit CONFIG"):
        find_pipeline("latest", str(tmp_path / "elsewhere"))


def test_only_the_users_own_pipeline_files_are_trusted(tmp_path: Path) -> None:
    """In a shared log_dir, another uid's pipeline.json with a future `submitted` date won `latest`,
    and status sent the user's MLflow password to the tracking_uri it named."""
    import os

    log_dir = tmp_path / "slurm"
    (log_dir / "pipelines").mkdir(parents=True)
    (log_dir / "pipelines").chmod(0o1777)
    mine = _write_pipeline(log_dir, "toy-mine", {"train": "1"}, [], submitted="2026-11-29T22:15:00")
    theirs = _write_pipeline(log_dir, "toy-theirs", {"train": "2"}, [], submitted="2099-01-01T00:00:00",
                             uri="http://attacker.invalid:5000")
    os.chown(theirs, 65534, 65534)
    os.chown(theirs.parent, 65534, 65534)
    assert find_pipeline("latest", str(log_dir)) == mine
    with pytest.raises(UserError, match=r"toy-theirs.*refusing to trust it \(.*belongs to uid 65534"):
        st.load_pipeline(theirs)
    loose = _write_pipeline(log_dir, "toy-loose", {"train": "3"}, [], submitted="2099-01-02T00:00:00")
    loose.chmod(0o666)
    linked = _write_pipeline(log_dir, "toy-linked", {"train": "4"}, [], submitted="2099-01-03T00:00:00")
    linked.unlink()
    linked.symlink_to(mine)
    assert find_pipeline("latest", str(log_dir)) == mine  # neither the 0666 file nor the link
    with pytest.raises(UserError, match=r"may be written by others \(mode 666\)"):
        st.load_pipeline(loose)
    with pytest.raises(UserError, match="is a symbolic link"):
        st.load_pipeline(linked)
    assert st.load_pipeline(mine)["jobs"] == {"train": "1"}


def test_relative_train_dirs_are_found_from_elsewhere(tmp_path: Path, monkeypatch) -> None:
    # submit ran in tmp_path; status runs from another directory.
    pf = _write_pipeline(tmp_path / "runs" / "slurm", "toy", {"train": "12"}, ["runs/train/toy/v0/train"])
    _progress(tmp_path / "runs" / "train" / "toy" / "v0" / "train", 1000.0, step=7)
    monkeypatch.chdir(tmp_path / "runs")
    assert st.progress_text("runs/train/toy/v0/train", pf, now=1010.0) == "7/100 loss 0.810 5.1 samples/s ETA 1m33s"
    assert st.progress_text("runs/train/toy/v9/train", pf) == ""


# ---- CLI ----------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["status", "cancel"])
def test_cli_builds_each_command(command: str, tmp_path: Path, capsys) -> None:
    args = cli.build_parser([command]).parse_args([command, "--log-dir", str(tmp_path)])
    assert args.pipeline == "latest" and args.log_dir == str(tmp_path)
    assert args.func is (st._status_cmd if command == "status" else st._cancel_cmd)
    assert cli.main([command, "nope", "--log-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no pipeline 'nope'")


def test_wait_blocks_until_every_job_ended_and_says_whether_all_completed(monkeypatch, tmp_path: Path) -> None:
    """`dspark status --wait`: a line per change of the summary, the full report at the end, and
    the exit code a script can branch on. A requeued job, or one sacct does not list yet, has not ended."""
    def js(i: str, state: str) -> JobState:
        return JobState(i, "x", state, "00:00:01", "0:0", "node1")

    sequence = [
        {"12": js("12", "PENDING")},  # the report is not in sacct yet
        {"12": js("12", "RUNNING"), "15": js("15", "PENDING")},
        {"12": js("12", "RUNNING"), "15": js("15", "PENDING")},  # unchanged: no new line
        {"12": js("12", "REQUEUED"), "15": js("15", "PENDING")},  # preempted and requeued: not over
        {"12": js("12", "COMPLETED"), "15": js("15", "COMPLETED")},
    ]
    calls: list[int] = []
    monkeypatch.setattr(st, "job_states", lambda ids: sequence[min(len(calls), len(sequence) - 1)])
    monkeypatch.setattr(st.time, "sleep", lambda s: calls.append(1))
    pf = _write_pipeline(tmp_path, "toy", {"train": "12", "report": "15"}, [])
    lines: list[str] = []
    assert st.wait(pf, 0.1, out=lambda text, **kw: lines.append(text)) == 0
    assert len(calls) == 4  # slept between the five reads, and not after the last
    changes = [ln.split("  ", 1)[1] for ln in lines[:-1]]
    assert changes == ["1 pending, 1 unknown", "1 running, 1 pending", "1 pending, 1 requeued"]
    assert lines[-1].splitlines()[-1] == "2 completed"

    sequence[:] = [{"12": js("12", "FAILED"), "15": js("15", "CANCELLED")}]
    lines.clear()
    assert st.wait(pf, 0.1, out=lambda text, **kw: lines.append(text)) == 1
    assert lines[-1].startswith("not every job completed: train 12 FAILED, report 15 CANCELLED")

    with pytest.raises(UserError, match="--interval 0"):
        st._status_cmd(SimpleNamespace(pipeline=str(pf), log_dir=str(tmp_path), wait=True, interval=0.0))
