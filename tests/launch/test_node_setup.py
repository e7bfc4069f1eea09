"""What node 0 does once per job: a job id that comes back (a reset cluster counts from 1 again)
must not hand a new job an old job's prepared data or directory."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from hpc.config import load_config, to_object
from hpc.errors import UserError
from hpc.launch import node_setup
from hpc.launch.slurm_env import SlurmEnv, attempt_dir

ROOT = Path(__file__).resolve().parents[2]


def _env(node: int, restart: int = 0) -> SlurmEnv:
    return SlurmEnv(job_id=42, node_index=node, n_nodes=2, hostnames=["a", "b"], requeue_id="42",
                    restart_count=restart)


def _config(out, *overrides: str):
    return to_object(load_config(str(ROOT / "configs/toy-cpu.yaml"), [f"train.output_dir={out}", *overrides]))


@pytest.fixture
def job(tmp_path, monkeypatch):
    """The toy config in tmp_path, with prepare_data counted instead of run."""
    monkeypatch.chdir(ROOT)
    cfg = _config(tmp_path / "run")
    calls = []
    import hpc.data.prepare as prepare

    monkeypatch.setattr(prepare, "prepare_data", lambda c: calls.append(c) or SimpleNamespace(
        stats=SimpleNamespace(summary=lambda: "ok")))
    monkeypatch.setattr(node_setup, "POLL_S", 0.05)
    monkeypatch.setattr(node_setup, "PREPARE_TIMEOUT_S", 20.0)  # a failing test ends, not hangs an hour
    marker = tmp_path / "run" / "data" / ".prepared-42"
    return SimpleNamespace(cfg=cfg, calls=calls, marker=marker)


def _age(path: Path, days: float = 30) -> None:
    os.utime(path, (path.stat().st_mtime - days * 86400,) * 2)


def test_a_first_attempt_prepares_even_where_an_older_job_42_left_its_marker(job):
    node_setup.prepare_once(job.cfg, _env(0))
    assert len(job.calls) == 1 and json.loads(job.marker.read_text())["settings"]["max_seq_len"] == 512
    _age(job.marker)  # last month's job 42, same output directory
    got = threading.Event()
    reader = threading.Thread(target=lambda: (node_setup.prepare_once(job.cfg, _env(1)), got.set()), daemon=True)
    reader.start()
    reader.join(0.5)
    assert reader.is_alive()  # node 1 does not take the stale marker: it waits for node 0
    node_setup.prepare_once(job.cfg, _env(0))
    reader.join(10)
    assert got.is_set() and len(job.calls) == 2


def test_a_requeued_attempt_reuses_its_own_marker_but_not_one_for_other_data(job):
    node_setup.prepare_once(job.cfg, _env(0))
    _age(job.marker, days=0.5)  # the first attempt ran hours ago
    node_setup.prepare_once(job.cfg, _env(0, restart=1))
    node_setup.prepare_once(job.cfg, _env(1, restart=1))
    assert len(job.calls) == 1
    other = _config(job.cfg.train.output_dir, "data.max_seq_len=256")
    node_setup.prepare_once(other, _env(0, restart=1))
    assert len(job.calls) == 2


def test_an_old_failure_does_not_stop_the_other_nodes_but_a_new_one_does(job):
    failed = job.marker.with_name(".prepared-42.error")
    failed.parent.mkdir(parents=True)
    from hpc.data.prepare import data_settings

    settings = json.loads(json.dumps(data_settings(job.cfg)))
    failed.write_text(json.dumps({"settings": settings, "attempt": 0, "error": "disk full"}))
    failed.chmod(0o600)  # as publish() writes it
    _age(failed)
    said: list[str] = []

    def node_1() -> None:
        try:
            node_setup.prepare_once(job.cfg, _env(1))
        except UserError as err:
            said.append(str(err))

    reader = threading.Thread(target=node_1, daemon=True)
    reader.start()
    reader.join(0.5)
    assert reader.is_alive() and not said  # last month's failure is not this job's
    os.utime(failed)  # node 0 fails now
    reader.join(10)
    assert said == ["node 0 failed: disk full"]


def test_a_first_attempt_takes_a_fresh_directory_and_a_requeue_its_own(tmp_path):
    assert attempt_dir(tmp_path, "retrain-42", 0) == tmp_path / "retrain-42"
    assert (tmp_path / "retrain-42").is_dir()
    assert attempt_dir(tmp_path, "retrain-42", 1) == tmp_path / "retrain-42"
    # job 42 again after a cluster reset: its first attempt must not resume the finished run
    assert attempt_dir(tmp_path, "retrain-42", 0) == tmp_path / "retrain-42.2"
    assert attempt_dir(tmp_path, "retrain-42", 2) == tmp_path / "retrain-42.2"
    (tmp_path / "retrain-420").mkdir()  # another job's id, not a numbered attempt
    assert attempt_dir(tmp_path, "retrain-42", 0) == tmp_path / "retrain-42.3"
    assert attempt_dir(tmp_path, "retrain-7", 1) == tmp_path / "retrain-7"  # nothing yet: not created
    assert not (tmp_path / "retrain-7").exists()


def test_a_requeue_after_a_first_attempt_cut_short_while_preparing_prepares(job, monkeypatch):
    """Job 42's first attempt ignored last month's marker, then was preempted mid-preparation:
    its requeue must not take that marker as its own."""
    import hpc.data.prepare as prepare

    job.marker.parent.mkdir(parents=True)
    job.marker.write_text(json.dumps({"settings": json.loads(json.dumps(prepare.data_settings(job.cfg)))}))
    job.marker.chmod(0o600)  # as publish() writes it
    _age(job.marker)

    def preempted(cfg):
        raise KeyboardInterrupt  # stands in for the job being killed

    monkeypatch.setattr(prepare, "prepare_data", preempted)
    with pytest.raises(KeyboardInterrupt):
        node_setup.prepare_once(job.cfg, _env(0))
    monkeypatch.setattr(prepare, "prepare_data", lambda c: job.calls.append(c) or SimpleNamespace(
        stats=SimpleNamespace(summary=lambda: "ok")))
    node_setup.prepare_once(job.cfg, _env(0, restart=1))
    assert len(job.calls) == 1


def test_the_last_attempts_failure_does_not_stop_a_requeue(job):
    from hpc.data.prepare import data_settings

    failed = job.marker.with_name(".prepared-42.error")
    failed.parent.mkdir(parents=True)
    failed.write_text(json.dumps({"settings": json.loads(json.dumps(data_settings(job.cfg))), "attempt": 0,
                                  "error": "disk full"}))  # a minute ago, attempt 1
    failed.chmod(0o600)  # as publish() writes it
    reader = threading.Thread(target=node_setup.prepare_once, args=(job.cfg, _env(1, restart=1)), daemon=True)
    reader.start()
    reader.join(0.5)
    assert reader.is_alive()  # it waits for this attempt's node 0
    node_setup.prepare_once(job.cfg, _env(0, restart=1))
    reader.join(10)
    assert not reader.is_alive() and len(job.calls) == 1


@pytest.mark.parametrize("plant", ["foreign owner", "group-writable", "group-readable", "symlink"])
def test_a_marker_this_user_did_not_write_is_not_trusted(tmp_path, plant):
    """cluster.log_dir can be a team's group-writable directory, and an mtime is whatever its
    writer sets: a co-user's planted `.target-<jobid>` made node 1 load their directory as the
    target, with trust_remote_code."""
    ours = {"model": "moonshotai/Kimi-K2.6", "revision": None}
    marker = tmp_path / ".target-42"
    planted = tmp_path / "theirs"
    planted.write_text(json.dumps({**ours, "path": "/home/mallory/evil"}))
    os.chmod(planted, 0o600)
    assert node_setup._answer_for(planted, ours, 0.0) is not None  # as publish() writes it, it would answer
    if plant == "foreign owner":
        planted.rename(marker)
        os.chown(marker, 12345, 12345)  # the tests run as root: any other uid is a co-user
    elif plant == "group-writable":
        planted.rename(marker)
        os.chmod(marker, 0o664)
    elif plant == "group-readable":  # not what publish() writes: someone else made it, or changed it
        planted.rename(marker)
        os.chmod(marker, 0o640)
    else:
        marker.symlink_to(planted)
    assert node_setup._answer_for(marker, ours, 0.0) is None
