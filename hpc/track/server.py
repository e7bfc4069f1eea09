"""A local MLflow tracking server: SQLite backend, bound to one address, stopped by pid.

Many Slurm jobs writing one SQLite file over NFS corrupt it; one server that owns the file
and serves HTTP to every job does not. Tests and the CPU demo use this; a real cluster points
`tracking.uri` at its own long-lived server.

MLflow 3.x checks every API request's Host header against an allow-list (against DNS rebinding);
by default the list holds loopback and the private ranges only, so a server on a login node's
name or public address answers 403 to every job. The server is therefore started with the
names and addresses it serves, in the host and host:port forms clients send: its bind address,
the names that resolve to it, and any the caller adds (`extra_hosts`: a DNS alias).
"""

from __future__ import annotations

import errno
import ipaddress
import os
import secrets
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hpc.config.secrets import redact_args
from hpc.errors import UserError
from hpc.fsio import own_dir, private_file, write_text
from hpc.net import free_port
from hpc.proc import SubprocessServer, http_ok, spawn

AUTH_DB = "basic_auth.db"  # MLflow basic auth's users: the admin keeps the password it was made with


def _check_host(host: str) -> None:
    """One line naming --host when it is no address of this machine (`hostname -i` can print a
    loopback alias, or several addresses): a bind there fails whatever the port."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, 0))
        except socket.gaierror as err:
            raise UserError(f"mlflow server: --host {host!r} does not resolve ({err.strerror}); give this "
                            "node's address, e.g. one of `hostname -I`") from None
        except OSError as err:
            if err.errno == errno.EADDRNOTAVAIL:
                raise UserError(f"mlflow server: --host {host} is not an address of this machine; give one "
                                "of `hostname -I` (or 127.0.0.1 for this node only)") from None
            raise


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        # As the server itself binds: a port in TIME_WAIT after a restart is free, a listener is not.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


WILDCARDS = ("0.0.0.0", "::", "")


def this_machines_addresses() -> list[str]:
    """Every address of this machine (loopback last): what a server on 0.0.0.0 or :: serves."""
    import psutil  # psutil: only for a wildcard bind

    found = [a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs
             if a.family in (socket.AF_INET, socket.AF_INET6)]
    try:  # the address this machine's name resolves to comes first: it is the one others know
        own = socket.gethostbyname(socket.gethostname())
    except OSError:
        own = ""
    return sorted(dict.fromkeys(found),
                  key=lambda a: (ipaddress.ip_address(a).is_loopback, a != own, ":" in a, a))


def _names_of(addr: str) -> list[str]:
    """The names that resolve to `addr` (/etc/hosts, DNS); a client may dial any of them."""
    try:
        name, aliases, _ = socket.gethostbyaddr(addr)
    except OSError:
        return []
    return [name, *aliases]


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def allowed_hosts(addresses: list[str], port: int, extra: tuple[str, ...] = ()) -> list[str]:
    """The Host headers clients send for these addresses and names: `host` and `host:port`
    (IPv6 in brackets). Loopback adds localhost, as MLflow's own default does."""
    hosts: list[str] = []
    for addr in addresses:
        hosts += [addr, *_names_of(addr)]
        if _is_address(addr) and ipaddress.ip_address(addr).is_loopback:
            hosts.append("localhost")
    hosts += list(extra)
    out: list[str] = []
    for h in dict.fromkeys(hosts):
        bare = f"[{h}]" if ":" in h else h
        out += [bare, f"{bare}:{port}"]
    return out


def is_healthy(uri: str, timeout: float = 2.0) -> bool:
    return http_ok(uri.rstrip("/") + "/health", timeout)


@dataclass
class MlflowServer(SubprocessServer):
    root: Path
    host: str = "127.0.0.1"
    port: int = 0
    proc: subprocess.Popen | None = None
    # MLflow's basic-auth app: every API call needs this admin's (or another user's) password.
    auth_password: str | None = None
    auth_user: str = "dspark"
    # 0.0.0.0 / :: serve every interface: refused unless asked for (a login node's outside one too).
    all_interfaces: bool = False
    extra_hosts: tuple[str, ...] = ()  # more names clients dial it by (a DNS alias), for MLflow's Host check
    stop_grace = 10.0  # a class attribute (no annotation): SIGTERM to SIGKILL
    log_path: Path = field(init=False)

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        self.log_path = self.root / "server.log"

    @property
    def served(self) -> list[str]:
        """What it answers on, the URI's host first: the bind address (a name, then its addresses),
        or every address of this machine for a wildcard."""
        if self.host in WILDCARDS:
            return this_machines_addresses()
        if _is_address(self.host):
            return [self.host]
        try:
            addrs = [str(a[4][0]) for a in socket.getaddrinfo(self.host, None, type=socket.SOCK_STREAM)]
        except OSError:
            addrs = []
        return list(dict.fromkeys([self.host, *addrs]))

    @property
    def uri(self) -> str:
        """A URI clients can dial: never the wildcard, which is no address to connect to."""
        host = self.served[0]
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    @property
    def what(self) -> str:
        return "mlflow server"

    def healthy(self) -> bool:
        return is_healthy(self.uri)

    def check_address(self) -> None:
        """--host is an address of this machine, and a wildcard only when asked for: before anything is made."""
        if self.host in WILDCARDS and not self.all_interfaces:
            raise UserError(f"mlflow server: --host {self.host or repr('')} listens on every interface of this "
                            "machine, outside ones too; give the address the compute nodes reach (one of "
                            "`hostname -I`), or pass --all-interfaces to mean it")
        _check_host(self.host)

    def start(self, timeout_s: float = 90.0) -> MlflowServer:
        self.check_address()
        self._own_root()
        self.port = self.port or free_port(self.host)
        if is_healthy(self.uri, timeout=1.0) or not _bindable(self.host, self.port):
            # Else the health probe would be answered by whoever holds the port, not by us.
            raise UserError(f"mlflow server: port {self.port} on {self.host} is already in use; pick another")
        cmd = [
            sys.executable, "-m", "mlflow", "server",
            "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
            "--artifacts-destination", str(self.root / "artifacts"),
            "--host", self.host, "--port", str(self.port), "--workers", "1",
            "--allowed-hosts", ",".join(allowed_hosts(self.served, self.port, self.extra_hosts)),
        ]
        # No job runner: MLflow's GenAI jobs are not ours, and the runner's store is a temp dir in
        # /dev/shm that MLflow never removes (one per server start, left in node RAM).
        env = {**os.environ, "MLFLOW_ENABLE_ASYNC_LOGGING": "false", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        if self.auth_password:
            cmd += ["--app-name", "basic-auth"]
            env.update(MLFLOW_AUTH_CONFIG_PATH=str(self._auth_config()), MLFLOW_AUTH_ADMIN_PASSWORD=self.auth_password,
                       # CSRF key of the auth app's forms: one server, so a fresh one per start is consistent.
                       MLFLOW_FLASK_SERVER_SECRET_KEY=secrets.token_hex(32))
        # Own session: stop() signals the whole group (the server forks workers). umask 077: what it
        # makes (journals, artifact directories and files) is the owner's alone, as its root is.
        self.proc = spawn(cmd, self.log_path, env=env, cwd=self.root, append=True, shown=redact_args(cmd),
                          umask=0o077)
        self.wait_healthy(timeout_s)
        return self

    def _own_root(self) -> None:
        """The root is ours alone (0700), or refused: other users share the login node, and the
        store, the users' database and the credentials live here. Its stores are 0600 files and its
        artifacts a 0700 directory, made so before MLflow opens them (never through a link)."""
        try:
            own_dir(self.root)
            own_dir(self.root / "artifacts")
            for name in ("mlflow.db", AUTH_DB):
                private_file(self.root / name)
        except PermissionError as err:
            raise UserError(f"mlflow server: {err}; refusing to keep a tracking store there: pass --root a "
                            "directory of your own (it is made 0700)") from None
        except OSError as err:
            raise UserError(f"mlflow server: {err.filename}: {err.strerror} (a link?); remove it, or pass "
                            "another --root") from None

    def _auth_config(self) -> Path:
        """MLflow's auth settings: users in their own SQLite file next to ours; nobody but a
        user with a password may read or write (the password goes by environment, not file)."""
        path = self.root / "auth.ini"
        # A new file renamed into place: a link planted at the name is replaced, never written through.
        write_text(path, "[mlflow]\ndefault_permission = NO_PERMISSIONS\n"
                   f"database_uri = sqlite:///{self.root / AUTH_DB}\n"
                   f"admin_username = {self.auth_user}\n"
                   "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n", mode=0o600)
        return path

    def __enter__(self) -> MlflowServer:
        return self.start()
