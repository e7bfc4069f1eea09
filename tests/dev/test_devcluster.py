"""The dev Slurm cluster end to end: real jobs through submitit 1.5.4, and its error paths.

The cluster tests share one session cluster (`slurm_cluster`); under CI=true a cluster that
cannot come up fails them instead of skipping.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, TypeVar

import cloudpickle
import pytest
import submitit
from submitit.core.utils import FailedJobError

from hpc.errors import UserError
from hpc_dev import devcluster, devcluster_host
from hpc_dev.dev_cli import main
from hpc_dev.devcluster import DevCluster
from hpc_dev.devcluster_conf import DevClusterSpec, render_slurm_conf
from tests.fixtures.slurm import SlurmCluster
from tests.fixtures.wait import wait_until
from tests.launch import slurm_jobs

# Jobs unpickle these functions in a fresh interpreter that may not have the repo on its path.
cloudpickle.register_pickle_by_value(slurm_jobs)

JOB_TIMEOUT_S = 60.0
R = TypeVar("R")


def _executor(cluster: SlurmCluster, folder: Path, **params: Any) -> submitit.AutoExecutor:
    # tmp_path is on the one host every "node" shares, so it works as submitit's shared folder.
    executor = submitit.AutoExecutor(folder=folder / "%j", cluster="slurm")
    executor.update_parameters(
        # 5 minutes: submitit signals USR2 90 s before the limit, and a 2-minute limit left a loaded
        # machine 30 s to start Python, unpickle and run a 3 s task (it timed out in CI once).
        slurm_partition=cluster.partition, timeout_min=5, cpus_per_task=1, **params
    )
    return executor


def _result(job: submitit.Job[R]) -> R:
    # Job.result() blocks forever on a stuck job; bound it so a failure names the job.
    wait_until(job.done, JOB_TIMEOUT_S, 0.25, f"job {job.job_id} done")
    return job.result()


def _max_overlap(intervals: list[tuple[float, float]]) -> int:
    # At equal times an end sorts before a start: back-to-back tasks do not overlap.
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return peak


# ---- the cluster itself -------------------------------------------------------------------


@pytest.mark.timeout(30, func_only=True)
def test_up_is_idempotent_and_status_reports_idle(
    slurm_cluster: SlurmCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = DevCluster(slurm_cluster.state_dir, partition=slurm_cluster.partition)
    start = time.monotonic()
    assert cluster.up() is False
    assert time.monotonic() - start < 5

    assert main(["devcluster", "up", "--dir", str(slurm_cluster.state_dir)]) == 0
    out = capsys.readouterr().out
    assert "already up" in out
    assert f"export SLURM_CONF={slurm_cluster.env['SLURM_CONF']}" in out

    assert main(["devcluster", "status", "--dir", str(slurm_cluster.state_dir)]) == 0
    out = capsys.readouterr().out
    for name in ["munged", "mariadbd", "slurmdbd", "slurmctld"]:
        assert re.search(rf"^\s+{name}\s+running, pid \d+$", out, re.M), out
    for node in slurm_cluster.node_names:
        assert re.search(rf"^{node} {slurm_cluster.partition}\*? idle ", out, re.M), out


# ---- real jobs through submitit ------------------------------------------------------------


@pytest.mark.timeout(90, func_only=True)
def test_array_parallelism_limit_holds(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    limit, count = 2, 4
    # 3 nodes x 2 CPUs could run all 4 tasks at once: only the array limit holds them back.
    executor = _executor(slurm_cluster, tmp_path, slurm_array_parallelism=limit)
    jobs = executor.map_array(slurm_jobs.timed_square, range(count), [3.0] * count)
    results = [_result(job) for job in jobs]

    assert [r[0] for r in results] == [x * x for x in range(count)]
    peak = _max_overlap([(start, end) for _, start, end in results])
    assert peak <= limit, f"{peak} tasks overlapped with slurm_array_parallelism={limit}"
    # The throttle is Slurm's, not an accident of scheduling: it is in the array spec submitted.
    scripts = list(tmp_path.rglob("*submission*.sh"))
    assert any(f"--array=0-{count - 1}%{limit}" in p.read_text() for p in scripts), scripts


@pytest.mark.timeout(90, func_only=True)
def test_two_node_job_gloo_all_reduce(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    executor = _executor(slurm_cluster, tmp_path, nodes=2, tasks_per_node=1)
    job = executor.submit(slurm_jobs.gloo_all_reduce)
    wait_until(job.done, JOB_TIMEOUT_S, 0.25, f"job {job.job_id} done")
    results = sorted(job.results(), key=lambda r: r["rank"])

    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world_size"] == 2 for r in results)
    assert all(r["value"] == 3.0 for r in results), results  # (0 + 1) + (1 + 1) on every rank
    nodes = [r["node"] for r in results]
    assert len(set(nodes)) == 2 and set(nodes) <= set(slurm_cluster.node_names), nodes
    assert [r["node_id"] for r in results] == [0, 1]
    assert all(r["master_addr"] == nodes[0] for r in results)
    addrs = slurm_cluster.cluster.node_addrs()
    assert [r["addr"] for r in results] == [addrs[n] for n in nodes]  # each rank on its own node's address


@pytest.mark.timeout(90, func_only=True)
def test_afterok_child_of_failed_parent_is_cancelled(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    executor = _executor(slurm_cluster, tmp_path)
    parent = executor.submit(slurm_jobs.fail, "parent fails on purpose")
    executor.update_parameters(slurm_dependency=f"afterok:{parent.job_id}")
    marker = tmp_path / "child-ran"
    child = executor.submit(slurm_jobs.touch, str(marker))

    with pytest.raises(FailedJobError, match="parent fails on purpose"):
        _result(parent)

    # job.state is cached by submitit's watcher: ask sacct afresh on every poll.
    def child_state() -> str:
        return child.get_info(mode="force").get("State", "")

    wait_until(lambda: child_state() not in {"", "PENDING", "RUNNING", "UNKNOWN"}, 30, 0.25, "child leaves PENDING")
    assert child_state().startswith("CANCELLED"), child_state()
    sacct = subprocess.run(
        ["sacct", "-n", "-X", "-P", "-j", child.job_id, "-o", "State,AllocNodes,NodeList"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    # Start is no proof: Slurm may stamp it with the cancel time. No allocation is.
    state, alloc_nodes, nodelist = sacct.split("|")
    assert state.startswith("CANCELLED") and alloc_nodes == "0", sacct
    assert nodelist == "None assigned", sacct
    assert not marker.exists()
    assert not child.paths.result_pickle.exists()


# ---- error paths (no cluster needed) --------------------------------------------------------


def test_missing_binaries_without_root_is_one_line_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(devcluster_host.shutil, "which", lambda *a, **k: None)
    monkeypatch.setattr(devcluster_host.os, "geteuid", lambda: 1000)
    state = tmp_path / "dc"

    assert main(["devcluster", "up", "--dir", str(state)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("error: devcluster needs munged")
    assert "slurmctld" in err[0] and "root on Debian/Ubuntu" in err[0]
    assert not state.exists()


def test_failed_apt_install_is_one_line_error(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []

    def fake_run(argv: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 100, "", "E: Unable to locate package slurmd\n")

    monkeypatch.setattr(devcluster_host, "missing_binaries", lambda: ["slurmd"])
    monkeypatch.setattr(devcluster_host, "can_apt_install", lambda: True)
    monkeypatch.setattr(devcluster_host, "_no_service_starts", contextlib.nullcontext)
    monkeypatch.setattr(devcluster_host.subprocess, "run", fake_run)

    with pytest.raises(UserError) as info:
        devcluster_host.ensure_installed()
    message = str(info.value)
    assert "\n" not in message
    assert "apt-get install" in message and "Unable to locate package slurmd" in message
    assert ["apt-get", "update"] in calls  # retried after refreshing the package lists


def test_up_needs_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devcluster, "ensure_installed", lambda: None)
    monkeypatch.setattr(devcluster.os, "geteuid", lambda: 1000)
    with pytest.raises(UserError, match="must run as root"):
        DevCluster(tmp_path / "dc").up()


def test_hosts_entries_added_once(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n10.9.0.2 node1  # already there")
    pairs = [("10.9.0.1", "dspark-login"), ("10.9.0.2", "node1"), ("10.9.0.3", "node2")]
    assert devcluster_host.ensure_hosts_entries(pairs, hosts)
    assert not devcluster_host.ensure_hosts_entries(pairs, hosts)
    assert hosts.read_text().splitlines()[-2:] == ["10.9.0.1 dspark-login  # dspark-devcluster",
                                                   "10.9.0.3 node2  # dspark-devcluster"]
    # a new subnet rewrites our lines, and only ours
    assert devcluster_host.ensure_hosts_entries([("10.8.0.1", "dspark-login"), ("10.9.0.2", "node1")], hosts)
    assert hosts.read_text() == "127.0.0.1 localhost\n10.9.0.2 node1  # already there\n" \
                                "10.8.0.1 dspark-login  # dspark-devcluster\n"


def test_a_node_name_someone_else_maps_elsewhere_is_one_line(tmp_path: Path) -> None:
    """The resolver takes the first line: node1 would dial 127.0.0.1, not its namespace."""
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost node1\n")
    with pytest.raises(UserError, match=r"maps node1 to 127\.0\.0\.1, the cluster needs 10\.9\.0\.2; remove that line"):
        devcluster_host.ensure_hosts_entries([("10.9.0.2", "node1")], hosts)
    assert hosts.read_text() == "127.0.0.1 localhost node1\n"


def test_slurm_conf_follows_spec() -> None:
    text = render_slurm_conf(DevClusterSpec(Path("/x"), partition="gpu", num_nodes=2, subnet="10.77.0.0/24"))
    assert "PartitionName=gpu Nodes=node1,node2 Default=YES" in text
    # each node its own address; the controller and accounting on the login side's
    assert "NodeName=node2 NodeHostname=localhost NodeAddr=10.77.0.3 Port=17002" in text
    assert "SlurmctldHost=localhost(10.77.0.1)" in text and "AccountingStorageHost=10.77.0.1" in text
    loop = render_slurm_conf(DevClusterSpec(Path("/x"), num_nodes=2, network="loopback"))
    assert "NodeName=node2 NodeHostname=localhost NodeAddr=127.0.0.1 Port=17002" in loop
    assert "node3" not in text
    assert "DependencyParameters=kill_invalid_depend" in text
    assert "AuthInfo=socket=/x/munge/munge.sock,cred_expire=10" in text
    assert "AccountingStoragePass=/x/munge/munge.sock" in text


# ---- running as root next to other users --------------------------------------------------

def test_a_state_dir_someone_else_created_is_refused(tmp_path: Path) -> None:
    planted = tmp_path / "dc"
    planted.mkdir(mode=0o777)
    (planted / "lock").symlink_to(tmp_path / "victim")
    os.chown(planted, 65534, 65534)  # nobody's
    with pytest.raises(UserError, match="belongs to uid 65534"):
        with DevCluster(planted)._locked():
            pass
    assert not (tmp_path / "victim").exists()
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(UserError, match="not a plain directory"):
        devcluster_host.secure_state_dir(link)
    # Inside a 0777 directory another user owns, which root later deletes under: refused.
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    os.chown(shared, 65534, 65534)
    with pytest.raises(UserError, match=r"shared belongs to uid 65534.*pass --dir"):
        devcluster_host.secure_state_dir(shared / "dc")
    assert not (shared / "dc").exists()


def test_files_are_written_without_following_planted_links(tmp_path: Path) -> None:
    cluster = DevCluster(tmp_path / "dc")
    s = cluster.spec
    with cluster._locked():
        pass
    assert stat.S_IMODE(os.stat(s.root).st_mode) == 0o711  # no listing, no writing by others
    victim = tmp_path / "shadow"
    victim.write_text("secret")
    victim.chmod(0o600)
    s.gpu_dir.mkdir(parents=True)
    s.etc_dir.mkdir(parents=True)
    (s.gpu_dir / "gpu0").symlink_to(victim)  # a "device" that is a link to a root-only file
    s.slurm_conf.symlink_to(victim)
    cluster._write_files()
    assert victim.read_text() == "secret" and stat.S_IMODE(victim.stat().st_mode) == 0o600
    dev = os.lstat(s.gpu_dir / "gpu0")
    assert stat.S_ISCHR(dev.st_mode) and (os.major(dev.st_rdev), os.minor(dev.st_rdev)) == (1, 3)
    assert not s.slurm_conf.is_symlink() and "ClusterName" in s.slurm_conf.read_text()


def test_a_process_with_a_daemons_name_is_not_taken_for_ours(tmp_path: Path) -> None:
    cluster = DevCluster(tmp_path / "dc")
    with cluster._locked():
        pass
    cluster.spec.run_dir.mkdir(parents=True, exist_ok=True)
    impostor = subprocess.Popen([sys.executable, "-c", "import time; open('/proc/self/comm', 'w').write('slurmctld'); "
                                 "time.sleep(60)"])
    try:
        wait_until(lambda: devcluster_host.comm_of(impostor.pid) == "slurmctld", 10, 0.05, "the impostor renamed")
        cluster.spec.pid_file("slurmctld").write_text(str(impostor.pid))
        assert cluster.pids()["slurmctld"] is None  # right name, but not started for this state dir
        assert cluster.down() is False and impostor.poll() is None  # so down() never signals it
    finally:
        impostor.kill()


def _process_named(comm: str, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", f"import time; open('/proc/self/comm', 'w').write({comm!r}); "
                             "time.sleep(60)", *args])
    wait_until(lambda: devcluster_host.comm_of(proc.pid) == comm, 10, 0.05, f"the process renamed {comm}")
    return proc


def test_a_daemon_of_a_sibling_state_dir_is_not_ours(tmp_path: Path) -> None:
    """`/x/dc` is a prefix of `/x/dc2`: the state dir must match as a whole path."""
    root = tmp_path / "dc"
    sibling = _process_named("slurmctld", "-f", f"{root}2/etc/slurm.conf")
    mine = _process_named("slurmctld", "-f", f"{root}/etc/slurm.conf")
    try:
        assert not devcluster_host.daemon_is_ours(sibling.pid, "slurmctld", root, root / "etc" / "slurm.conf")
        assert devcluster_host.daemon_is_ours(mine.pid, "slurmctld", root, root / "etc" / "slurm.conf")
    finally:
        sibling.kill()
        mine.kill()


@pytest.mark.parametrize("current", [False, True])
def test_stopping_calls_no_slurm_client_unless_the_conf_is_ours(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, current: bool
) -> None:
    """A conf we did not write (or that changed) could point squeue/scancel at a real cluster."""
    cluster = DevCluster(tmp_path / "dc")
    calls: list[list[str]] = []
    monkeypatch.setattr(devcluster.subprocess, "run",
                        lambda argv, **_: calls.append(argv) or subprocess.CompletedProcess(argv, 0, "", ""))
    monkeypatch.setattr(cluster, "_running_pid", lambda daemon: 4242)  # every daemon "running"
    monkeypatch.setattr(cluster, "_terminate", lambda pid: None)
    monkeypatch.setattr(cluster, "_configs_current", lambda: current)
    assert cluster._stop_all() is True
    assert [c[0] for c in calls] == (["squeue"] if current else [])


def test_a_host_with_a_real_slurm_is_refused_without_force(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    conf = tmp_path / "etc-slurm.conf"
    conf.write_text("ClusterName=prod\n")
    monkeypatch.setattr(devcluster_host, "REAL_SLURM_CONFS", (conf,))
    installed: list[bool] = []
    monkeypatch.setattr(devcluster, "ensure_installed", lambda: installed.append(True) or (_ for _ in ()).throw(
        UserError("stop here")))
    with pytest.raises(UserError, match=r"real Slurm .*etc-slurm.conf.*--force"):
        DevCluster(tmp_path / "dc").up()
    assert not installed  # refused before any package is installed
    with pytest.raises(UserError, match="stop here"):
        DevCluster(tmp_path / "dc").up(force=True)


def test_down_takes_out_the_hosts_line_up_added(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n10.0.0.5 db\n")
    devcluster_host.ensure_hosts_entries([("10.9.0.2", "node1"), ("10.9.0.3", "node2")], hosts)
    assert "node1" in hosts.read_text()
    assert devcluster_host.remove_hosts_entries(hosts)
    assert hosts.read_text() == "127.0.0.1 localhost\n10.0.0.5 db\n"
    assert not devcluster_host.remove_hosts_entries(hosts)


def test_only_the_cluster_that_added_the_hosts_line_takes_it_out(tmp_path: Path) -> None:
    """A second dev cluster (a test's own state dir) going down must not unname the live one's nodes."""
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n")
    live, other = tmp_path / "live", tmp_path / "other"
    live.mkdir(), other.mkdir()
    pairs = [("10.9.0.2", "node1"), ("10.9.0.3", "node2")]
    assert devcluster_host.ensure_hosts_entries(pairs, hosts, state_dir=live)
    assert not devcluster_host.ensure_hosts_entries(pairs, hosts, state_dir=other)  # already named
    assert not devcluster_host.remove_own_hosts_entries(other, hosts)
    assert "node1" in hosts.read_text()
    assert devcluster_host.remove_own_hosts_entries(live, hosts)
    assert hosts.read_text() == "127.0.0.1 localhost\n" and not (live / devcluster_host.HOSTS_ADDED).exists()
