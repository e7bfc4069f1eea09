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
