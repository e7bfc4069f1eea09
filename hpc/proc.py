"""A server in a subprocess: started, health-checked and stopped the one way (VLLMServer, MlflowServer).

It runs in its own process group with its output in a log file, so stopping it also stops
what it forks (vLLM's engine cores, MLflow's workers). It is ready when its health URL answers
200; one that exits first or never gets there raises one UserError naming the log, with its
last lines, which is where the cause is.

    @dataclass
    class MyServer(SubprocessServer):
        proc: subprocess.Popen
        log_path: Path
        def healthy(self) -> bool:
            return http_ok(f"{self.url}/health")
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import ClassVar

import psutil

from hpc import proc_guard
from hpc.errors import UserError


def spawn(cmd: Sequence[str], log_path: Path, *, env: Mapping[str, str] | None = None,
          cwd: str | Path | None = None, append: bool = False, shown: Sequence[str] | None = None,
          cleanup: Sequence[str | Path] = (), grace: float = 15.0, umask: int = -1) -> subprocess.Popen:
    """`cmd` in a new session (its own process group), its output and the command line in `log_path`
    (as `shown`, when the caller masked secrets in it).

    It runs under `hpc/proc_guard.py`, which takes the session down, removes `cleanup` and
    sweeps /dev/shm if this process dies first (a SIGKILL runs no handler of ours), with `grace`
    seconds between SIGTERM and SIGKILL, as `stop_group` gives."""
    guard = [sys.executable, "-I", proc_guard.__file__, str(os.getpid()), str(grace),
             json.dumps([str(p) for p in cleanup]),
             "--", *map(str, cmd)]
    # Never through a link someone planted where the log goes (it would append to their target).
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if append else os.O_TRUNC)
    try:
        fd = os.open(log_path, flags, 0o600)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise UserError(f"{log_path} is a symbolic link; a server log is never written through one: "
                            "remove it") from None
        raise
    with os.fdopen(fd, "w") as log:
        log.write("$ " + " ".join(map(str, cmd if shown is None else shown)) + "\n")
        log.flush()
        return subprocess.Popen(guard, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=None if env is None else dict(env), cwd=cwd, start_new_session=True,
                                umask=umask)


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """Whether a GET of `url` answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def group_alive(pgid: int) -> bool:
    """Any live (non-zombie) process in the group? `kill -0` says yes to zombies that a slow
    init has not reaped yet, so ask each process its state."""
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                return True
        except (psutil.Error, ProcessLookupError):
            continue
    return False


def stop_group(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM `proc`'s whole group; what is left of it after `grace` seconds gets SIGKILL.

    The group is `proc`'s own (spawn's new session), and is signalled even when `proc` has
    exited already: the processes it forked may still hold memory, ports or GPUs.
    """
    pgid = proc.pid
    deadline = time.monotonic() + grace
    # While a member lives, the pgid cannot be recycled: these signals reach nobody else's group.
    if proc.poll() is None or group_alive(pgid):
        signal_group(pgid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    while (alive := group_alive(pgid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    if alive:
        signal_group(pgid, signal.SIGKILL)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + 5  # SIGKILL is not instant: return when what held memory is gone
    while alive and (alive := group_alive(pgid)) and time.monotonic() < deadline:
        time.sleep(0.05)


class SubprocessServer:
    """What a server in a subprocess shares; a subclass has `proc` and `log_path`, says what it
    is in `what` (for messages) and whether it answers in `healthy()` (which may raise UserError
    when whoever answers is not our server: the server is then stopped)."""

    proc: subprocess.Popen | None
    log_path: Path
    stop_grace: ClassVar[float] = 15.0  # seconds between SIGTERM and SIGKILL

    @property
    def what(self) -> str:
        return "server"

    def healthy(self) -> bool:
        raise NotImplementedError

    def wait_healthy(self, timeout: float, poll: float = 0.5) -> None:
        assert self.proc is not None, "start the server first"
        try:
            self._wait_healthy(self.proc, timeout, poll)
        except BaseException:
            # Whatever ends the wait (it died, the deadline, Ctrl-C, a caller's error while the model
            # loads) stops it: it runs in a session of its own, out of reach of the signals that
            # end its caller, and would hold the node's GPUs after the caller is gone.
            self.stop()
            raise

    def _wait_healthy(self, proc: subprocess.Popen, timeout: float, poll: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if proc.poll() is not None:
                raise UserError(f"{self.what} exited with code {proc.returncode} before it was healthy; "
                                f"last lines of {self.log_path}:\n{log_tail(self.log_path)}")
            if time.monotonic() > deadline:
                raise UserError(f"{self.what} not healthy after {timeout:.0f}s; "
                                f"last lines of {self.log_path}:\n{log_tail(self.log_path)}")
            time.sleep(poll)

    def stop(self, grace: float | None = None) -> None:
        """SIGTERM the whole group, then SIGKILL what is left after ``grace`` seconds (stop_grace)."""
        if self.proc is not None:
            stop_group(self.proc, self.stop_grace if grace is None else grace)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
