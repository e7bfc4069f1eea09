"""The regeneration job's Ray cluster: commands, markers, and two real raylets sharing this host."""

from __future__ import annotations

import json
import os
import random

import psutil
import pytest

from hpc.data.regen_ray import REGEN_RESOURCE
from hpc.errors import UserError
from hpc.launch.job_files import job_file, publish, read_published, wait_published
from hpc.launch.ray_cluster import RayNode, _refresh_ray_auth, done_marker, ray_start_command
from hpc.launch.slurm_env import SlurmEnv
from tests.fixtures.wait import still_running

# The tests that start real Ray workers are slow and host-wide (one Ray per host at a time);
# the commands, job files and markers are unit tests of the fast suite.


def env(node: int, job: int = 4242, hosts=("localhost", "localhost")) -> SlurmEnv:
    return SlurmEnv(job, node, len(hosts), list(hosts), str(job))


def test_head_and_worker_commands():
    head = ray_start_command(env(0), 45678, object_store_mb=256, temp_dir="/tmp/private/r")
    worker = ray_start_command(env(1), 45678, object_store_mb=256, temp_dir="/tmp/own/r")
    assert head[head.index("--temp-dir") + 1] == "/tmp/private/r" and worker[worker.index("--temp-dir") + 1] == "/tmp/own/r"
    port = "45678"
    assert head[head.index("--port") + 1] == port and "--head" in head and "--address" not in head
    assert worker[worker.index("--address") + 1] == f"127.0.0.1:{port}" and "--head" not in worker
    for cmd in (head, worker):
        assert "--block" in cmd and json.loads(cmd[cmd.index("--resources") + 1]) == {REGEN_RESOURCE: 1}
        assert cmd[cmd.index("--object-store-memory") + 1] == str(256 * 2**20)
        # Every other port is the OS's choice, so raylets of two jobs (or two dev "nodes") share a host.
        assert cmd[cmd.index("--min-worker-port") + 1] == "0" and cmd[cmd.index("--dashboard-agent-listen-port") + 1] == "0"


def test_job_files_are_created_once_owner_only_and_checked_on_read(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    path = job_file(tmp_path, "rendezvous", 4242)
    publish(path, {"addr": "10.0.0.1", "port": 4321})
    assert path.stat().st_mode & 0o777 == 0o600 and read_published(path) == {"addr": "10.0.0.1", "port": 4321}
    with pytest.raises(UserError, match="exists already"):  # never overwritten, so never planted first
        publish(path, {"addr": "6.6.6.6", "port": 1})
    assert read_published(path)["addr"] == "10.0.0.1"
    planted = job_file(tmp_path, "ray-token", 4242)
    planted.write_text('{"port": 1, "token": "known"}')
    planted.chmod(0o644)  # someone else could have read (or written) it
    with pytest.raises(UserError, match="not an owner-only file"):
        read_published(planted)
    # A rendezvous file another user planted, owner-only on their side: not ours, not trusted.
    theirs = job_file(tmp_path, "rendezvous", 4343)
    theirs.write_text('{"addr": "6.6.6.6", "port": 1, "secret": "' + "0" * 64 + '"}')
    theirs.chmod(0o600)
    os.chown(theirs, 12345, 12345)  # the tests run as root: any other uid is a co-user
    with pytest.raises(UserError, match="not an owner-only file of yours"):
        read_published(theirs)


def test_an_earlier_jobs_file_under_the_same_id_is_replaced_never_read(tmp_path, monkeypatch):
    """Job ids start over on a reinstalled cluster, and a node that died left its files: an old
    rendezvous file of ours under this job's id is an earlier job's, not this one's."""
    import threading
    import time

    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    path = job_file(tmp_path, "rendezvous", 10)
    path.write_text('{"addr": "10.9.9.9", "port": 1, "secret": "old"}')
    path.chmod(0o600)
    old = time.time() - 3 * 86400
    os.utime(path, (old, old))
    got: dict = {}
    reader = threading.Thread(target=lambda: got.update(wait_published(path, 30, "node 1")))
    reader.start()  # a reader that starts first waits past the stale file ...
    time.sleep(1.0)
    assert not got
    publish(path, {"addr": "10.0.0.2", "port": 4321, "secret": "new"})  # ... which the publisher replaces
    reader.join(30)
    assert got == {"addr": "10.0.0.2", "port": 4321, "secret": "new"}
    # A recent file is this job's (or a co-user's plant): still never replaced.
    with pytest.raises(UserError, match="exists already"):
        publish(path, {"addr": "6.6.6.6", "port": 1})
    # Nor is an old one that is not ours: it is refused on read, as before.
    theirs = job_file(tmp_path, "rendezvous", 11)
    theirs.write_text("{}")
    theirs.chmod(0o644)
    os.utime(theirs, (old, old))
    with pytest.raises(UserError, match="exists already"):
        publish(theirs, {"addr": "6.6.6.6", "port": 1})


def test_a_requeued_job_does_not_see_the_last_runs_done_marker(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    first = done_marker(tmp_path, env(1))
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert done_marker(tmp_path, env(1)) != first and first.name.endswith("-4242-0")


def test_a_worker_without_node_0s_token_gives_up_with_a_pointer(tmp_path):
    with pytest.raises(UserError, match="node 0 published nothing"):
        RayNode(env(1, 77), tmp_path / "worker.log", token_timeout_s=1)


def test_a_node_whose_own_name_is_loopback_advertises_its_routed_address(monkeypatch):
    import hpc.launch.slurm_env as se

    table = {"n1": "127.0.1.1", "n2": "192.0.2.77"}  # Debian /etc/hosts on n1, DNS for n2
    monkeypatch.setattr(se, "node_ip", lambda h: table[h])
    ip = se.advertised_ip(env(0, hosts=("n1", "n2")))
    mine = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs}
    assert not ip.startswith("127.") and ip in mine  # an address of one of this machine's interfaces
    table.update(n2="127.0.0.1")  # every name loopback: the nodes are one host (the dev cluster)
    assert se.advertised_ip(env(0, hosts=("n1", "n2"))) == "127.0.1.1"


def test_an_unresolvable_node_is_named():
    with pytest.raises(UserError, match="nosuchnode.invalid"):
        ray_start_command(env(1, hosts=("nosuchnode.invalid", "localhost")), 45678, object_store_mb=256)


@pytest.mark.slow
@pytest.mark.host_wide
def test_two_raylets_share_this_host_and_leave_nothing_behind(tmp_path):
    import ray

    job = random.randrange(100000, 900000)
    head = RayNode(env(0, job), tmp_path / "head.log", object_store_mb=128)
    worker = RayNode(env(1, job), tmp_path / "worker.log", object_store_mb=128)
    family = []
    try:
        head.connect(2, timeout_s=120)
        assert ray.cluster_resources()[REGEN_RESOURCE] == 2
        family = [p for n in (head, worker) for p in psutil.Process(n.proc.pid).children(recursive=True)]
        assert len(family) >= 4  # gcs, raylets, agents...
        token = head.token_file
        assert token.stat().st_mode & 0o077 == 0 and worker.auth == head.auth  # one secret, owner-only
        # Ray makes its temp dir 0777: it sits inside one only we can enter.
        privates = [head.private, worker.private]  # each node's own, as Ray's sockets are per node
        assert all(p is not None and p.stat().st_mode & 0o077 == 0 and (p / "r").is_dir() for p in privates)
    finally:
        ray.shutdown()
        worker.stop()
        head.stop()
        for key in head.auth:  # connect() made this process a token-auth driver: undo for later tests
            os.environ.pop(key, None)
        _refresh_ray_auth()
    assert not still_running(family, timeout=10)
    assert not token.exists() and not any(p.exists() for p in privates if p is not None)


@pytest.mark.slow
@pytest.mark.host_wide
def test_a_worker_whose_raylet_dies_ends_cleanly_and_says_so(tmp_path):
    """Exit 0 either way: the job's fate is node 0's (its requests move to the other servers)."""
    job = random.randrange(100000, 900000)
    publish(job_file(tmp_path, "ray-token", job), {"port": 1, "token": "0" * 64})  # as node 0 would leave it
    worker = RayNode(env(1, job), tmp_path / "worker.log", object_store_mb=128)
    try:
        worker.proc.kill()
        worker.proc.wait(10)
        assert "the raylet exited" in worker.serve(poll_s=0.1, grace_s=0.5)
    finally:
        worker.stop()


def test_a_worker_arriving_after_node_0_finished_starts_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    done_marker(tmp_path, env(1, 99)).touch()  # node 0 is done and took its token away
    late = RayNode(env(1, 99), tmp_path / "worker.log", token_timeout_s=5)
    assert late.late and late.proc is None and late.serve() == "node 0 is done"
    late.stop()
