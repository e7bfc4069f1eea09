"""hpc/proc.py: a server in a subprocess, with plain Python processes standing in for vLLM and MLflow."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from hpc.errors import UserError
from hpc.net import free_port
from hpc.proc import SubprocessServer, group_alive, http_ok, spawn


@dataclass
class Fake(SubprocessServer):
    proc: subprocess.Popen
    log_path: Path
    port: int = 0
    stop_grace = 1.0

    @property
    def what(self) -> str:
        return "fake server"

    def healthy(self) -> bool:
        return http_ok(f"http://127.0.0.1:{self.port}/health", timeout=0.5)


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_server_that_exits_is_reported_with_its_log(tmp_path):
    log = tmp_path / "server.log"
    server = Fake(spawn(python("print('no such model: m'); raise SystemExit(3)"), log), log)
    with pytest.raises(UserError) as err:
        server.wait_healthy(timeout=30, poll=0.05)
    assert str(err.value).startswith("fake server exited with code 3 before it was healthy; last lines of "
                                     f"{log}:")
    assert "no such model: m" in str(err.value) and "$ " in log.read_text()  # the command line heads the log


def test_a_healthy_server_is_ready_and_its_whole_group_stops(tmp_path):
    port = free_port()
    # The leader forks a child that ignores SIGTERM, as a stuck worker would: it must still go.
    code = ("import http.server, os, signal, sys, time\n"
            "if os.fork() == 0:\n"
            "    signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120); sys.exit()\n"
            "class H(http.server.BaseHTTPRequestHandler):\n"
            "    def do_GET(self): self.send_response(200); self.end_headers()\n"
            f"http.server.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n")
    log = tmp_path / "server.log"
    with Fake(spawn(python(code), log), log, port) as server:
        server.wait_healthy(timeout=60, poll=0.05)
        pgid = server.proc.pid
        assert os.getpgid(pgid) == pgid != os.getpgid(0)  # its own group, not ours
        assert group_alive(pgid)
    assert server.proc.poll() is not None and not group_alive(pgid)


def test_a_server_that_never_gets_healthy_is_stopped_after_the_timeout(tmp_path):
    log = tmp_path / "server.log"
    server = Fake(spawn(python("import time; print('loading', flush=True); time.sleep(120)"), log), log,
                  free_port())
    start = time.monotonic()
    with pytest.raises(UserError, match=r"fake server not healthy after 1s; last lines of .*server.log:\n.*loading"):
        server.wait_healthy(timeout=1, poll=0.05)
    assert time.monotonic() - start < 30 and server.proc.poll() == -signal.SIGTERM


def test_a_wait_cut_short_stops_the_server_it_was_waiting_for(tmp_path, monkeypatch):
    """Ctrl-C while the model loads: the server is in a session of its own, so the signal that
    ends its caller never reaches it, and it would keep the node's GPUs."""
    log = tmp_path / "server.log"
    server = Fake(spawn(python("import time; time.sleep(120)"), log), log, free_port())
    sleeps = []

    def interrupted(seconds):
        sleeps.append(seconds)
        if len(sleeps) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr("hpc.proc.time.sleep", interrupted)
    with pytest.raises(KeyboardInterrupt):
        server.wait_healthy(timeout=60, poll=0.01)
    monkeypatch.undo()
    server.proc.wait(timeout=10)  # stopped, not orphaned
    assert server.proc.returncode is not None and not group_alive(server.proc.pid)


# ---- the guard: a server dies with its starter, and /dev/shm is left as it was --------------------

STARTER = r"""
import sys, time
from pathlib import Path
from hpc.proc import spawn
from hpc.verifier.vllm_backend import private_capture_dir

tmp = Path(sys.argv[1])
capture = private_capture_dir("/dev/shm", 1)  # what a capture server's starter makes
(capture / "sample-0.safetensors").write_bytes(b"x" * 1024)
server = spawn([sys.executable, "-c", sys.argv[2]], tmp / "server.log", cleanup=[capture], grace=1.0)
print(server.pid, capture, flush=True)
time.sleep(600)
"""

SERVER = r"""
import mmap, os, secrets, signal, sys, time
# A segment named as Python's shared_memory names vLLM's, mapped as vLLM maps it.
name = "/dev/shm/psm_dsparktest_" + secrets.token_hex(4)
fd = os.open(name, os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, 4096)
mem = mmap.mmap(fd, 4096)
if os.fork() == 0:  # a worker that ignores SIGTERM, as a stuck engine core would
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)
print("up" + "-and-mapped", flush=True)  # split: the log's first line holds the code
time.sleep(600)
"""


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


@pytest.mark.parametrize("starter_sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_server_dies_with_its_starter_and_leaves_dev_shm_as_it_was(tmp_path, starter_sig):
    """A SIGKILLed rank runs no handler: the guard notices it was re-parented, takes the whole
    session down (the TERM-ignoring worker too), removes the starter's capture directory and
    sweeps the segments the server mapped."""
    import psutil

    before = _shm()
    starter = subprocess.Popen([sys.executable, "-c", STARTER, str(tmp_path), SERVER], stdout=subprocess.PIPE,
                               text=True, cwd=Path(__file__).resolve().parents[1])
    try:
        guard_pid, capture = starter.stdout.readline().split()
        log = tmp_path / "server.log"
        deadline = time.monotonic() + 60
        while "up-and-mapped" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline, log.read_text() if log.exists() else "no log"
            time.sleep(0.05)
        session = os.getsid(int(guard_pid))
        server_pids = [p.pid for p in psutil.process_iter() if _sid(p.pid) == session]
        assert len(server_pids) == 3  # the guard, the server, its stuck worker
        assert Path(capture).is_dir() and any(n.startswith("psm_dsparktest_") for n in _shm() - before)
        starter.send_signal(starter_sig)
        starter.wait(timeout=10)
        deadline = time.monotonic() + 30
        while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                  for p in server_pids):
            assert time.monotonic() < deadline, "the server outlived its starter"
            time.sleep(0.1)
        # capture directory and segment gone (only ours: a test on another worker may map its own)
        assert {n for n in _shm() - before if n.startswith("psm_dsparktest_") or n == Path(capture).name} == set()
        assert "is gone; stopping it" in log.read_text()
    finally:
        starter.kill()


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def test_the_next_start_sweeps_what_dead_owners_left_and_nothing_else(tmp_path):
    from hpc.proc_guard import sweep_shm

    uid = os.getuid()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    old = time.time() - 3600
    orphan = tmp_path / "psm_orphan"  # nobody maps it: its server was SIGKILLed
    held = tmp_path / "psm_held"  # a live server of ours holds it
    young = tmp_path / "psm_young"  # just created, not yet mapped
    for p in (orphan, held, young):
        p.write_bytes(b"\0" * 64)
    os.utime(orphan, (old, old))
    os.utime(held, (old, old))
    gone_dir = tmp_path / f"dspark-{uid}-local-pid{int(dead.stdout)}-port1-abc"
    live_dir = tmp_path / f"dspark-{uid}-local-pid{os.getpid()}-port2-def"
    other = tmp_path / "not-ours"
    for d in (gone_dir, live_dir, other):
        d.mkdir()
    with open(held, "rb"):
        removed = sweep_shm(root=str(tmp_path))
    assert sorted(removed) == sorted([str(orphan), str(gone_dir)])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["psm_held", "psm_young", live_dir.name, "not-ours"])
