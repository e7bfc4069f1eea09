"""A local MLflow tracking server: SQLite backend, loopback only, stopped by pid.

Many Slurm jobs writing one SQLite file over NFS corrupt it; one server that owns the file
and serves HTTP to every job does not. Tests and the CPU demo use this; a real cluster points
`tracking.uri` at its own long-lived server.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from hpc.errors import UserError
from hpc.net import free_port


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        # As the server itself binds: a port in TIME_WAIT after a restart is free, a listener is not.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def group_alive(pgid: int) -> bool:
    """Any live (non-zombie) process in the group? `kill -0` says yes to zombies that a slow
    init has not reaped yet, so read /proc instead."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def is_healthy(uri: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


@dataclass
class MlflowServer:
    root: Path
    host: str = "127.0.0.1"
    port: int = 0
    proc: subprocess.Popen | None = None
    # MLflow's basic-auth app: every API call needs this admin's (or another user's) password.
    auth_password: str | None = None
    auth_user: str = "dspark"

    @property
    def uri(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.root / "server.log"

    def start(self, timeout_s: float = 90.0) -> MlflowServer:
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port(self.host)
        if is_healthy(self.uri, timeout=1.0) or not _bindable(self.host, self.port):
            # Else the health probe would be answered by whoever holds the port, not by us.
            raise UserError(f"mlflow server: port {self.port} on {self.host} is already in use; pick another")
        cmd = [
            sys.executable, "-m", "mlflow", "server",
            "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
            "--artifacts-destination", str(self.root / "artifacts"),
            "--host", self.host, "--port", str(self.port), "--workers", "1",
        ]
        env = {**os.environ, "MLFLOW_ENABLE_ASYNC_LOGGING": "false"}
        if self.auth_password:
            cmd += ["--app-name", "basic-auth"]
            env.update(MLFLOW_AUTH_CONFIG_PATH=str(self._auth_config()), MLFLOW_AUTH_ADMIN_PASSWORD=self.auth_password,
                       # CSRF key of the auth app's forms: one server, so a fresh one per start is consistent.
                       MLFLOW_FLASK_SERVER_SECRET_KEY=secrets.token_hex(32))
        with open(self.log_path, "ab") as log:
            # Own session: stop() signals the whole group (the server forks workers).
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True, cwd=self.root)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise UserError(f"mlflow server exited with {self.proc.returncode}: {self._tail()}")
            if is_healthy(self.uri):
                return self
            time.sleep(0.5)
        self.stop()
        raise UserError(f"mlflow server not healthy after {timeout_s:.0f} s: {self._tail()}")

    def _auth_config(self) -> Path:
        """MLflow's auth settings: users in their own SQLite file next to ours; nobody but a
        user with a password may read or write (the password goes by environment, not file)."""
        path = self.root / "auth.ini"
        path.write_text("[mlflow]\ndefault_permission = NO_PERMISSIONS\n"
                        f"database_uri = sqlite:///{self.root / 'basic_auth.db'}\n"
                        f"admin_username = {self.auth_user}\n"
                        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n")
        return path

    def _tail(self, lines: int = 5) -> str:
        try:
            return " | ".join(self.log_path.read_text().strip().splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        pgid = os.getpgid(self.proc.pid)
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait()
        # The server forks uvicorn and job workers into the same group: wait until all are gone.
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if not group_alive(pgid):
                return
            time.sleep(0.2)
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def __enter__(self) -> MlflowServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
