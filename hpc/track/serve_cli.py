"""`dspark tracking serve`: the MLflow server a cluster's jobs log to, with MLflow's own auth.

Every job of a pipeline writes to the tracking store at once; a SQLite file on a shared
filesystem does not survive concurrent writers, so `dspark submit` wants an http tracking URI.
This command runs one: SQLite (owned by this one process) and artifacts under --root, MLflow's
basic-auth app on, and a password drawn once and kept in `<root>/credentials.env` (0600).
Jobs authenticate through MLflow's standard variables, which Slurm passes on from the
submitting shell:

    dspark tracking serve --root /shared/mlflow --host ADDR    # ADDR: the interface the nodes reach
    source /shared/mlflow/credentials.env                      # on the login node
    dspark submit configs/kimi-k2.6-dspark.yaml tracking.uri=http://ADDR:PORT

MLflow answers only requests whose Host header it was told to serve: this command passes it
--host's address and every name that resolves to it (host and host:port); add a DNS alias the
nodes use with --allow-host. 0.0.0.0 or :: (every interface) needs --all-interfaces, and the
URI printed is still a real address.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import secrets
import signal
import threading
from pathlib import Path

from hpc.errors import UserError
from hpc.fsio import own_dir, read_trusted, untrusted, write_text
from hpc.track.server import AUTH_DB, MlflowServer

CREDENTIALS = "credentials.env"


def credentials(root: Path, user: str = "dspark") -> str:
    """The server's admin password: drawn once, kept owner-only under `root`."""
    path = root / CREDENTIALS
    users = root / AUTH_DB
    try:
        own_dir(root)  # 0700 and ours, or refused: the password is kept here
    except PermissionError as err:
        raise UserError(f"tracking server: {err}; pass --root a directory of your own") from None
    if os.path.lexists(path):
        st = os.lstat(path)
        if (why := untrusted(path)) is not None or st.st_mode & 0o077:
            why = why or f"{path} may be read by others (mode {st.st_mode & 0o777:o})"
            raise UserError(f"{path}: not a credentials file this command wrote ({why}); refusing its password. "
                            f"Remove it and {users} (the server's users) to draw a new one")
    if not os.path.lexists(path) and users.exists():
        # MLflow keeps an existing admin's password: a new one drawn here would lock every job out.
        raise UserError(f"{path} is gone but {users} still holds the admin password it named; restore the "
                        f"file, or delete {users} too to start the server's users over")
    if not path.is_file():
        password = secrets.token_urlsafe(24)
        try:  # whole or absent (tmp + link): a half-written file would lock the server out for good
            write_text(path, f"export MLFLOW_TRACKING_USERNAME={user}\nexport MLFLOW_TRACKING_PASSWORD={password}\n",
                       mode=0o600, exclusive=True)
        except FileExistsError:
            pass  # another server drew one first: share it
    for line in read_trusted(path).splitlines():
        if line.startswith("export MLFLOW_TRACKING_PASSWORD="):
            return line.split("=", 1)[1].strip()
    raise UserError(f"{path} has no `export MLFLOW_TRACKING_PASSWORD=` line; delete it and {users} (the "
                    "server's users, which keep the old password) to draw a new password, then re-source it "
                    "wherever jobs are submitted")


def _host_name(text: str) -> str:
    """--allow-host as argparse checks it: a DNS name or an address, as a Host header carries it."""
    bare = text.strip("[]")
    try:
        return str(ipaddress.ip_address(bare))
    except ValueError:
        pass
    labels = text.split(".")
    if len(text) > 253 or not all(re.fullmatch(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?", la) for la in labels):
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a host name or address (e.g. mlflow.cluster.local)")
    return text


def _port(text: str) -> int:
    """--port as argparse checks it, before anything is made under --root."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port (0..65535; 0 picks a free one)")
    return port


def run(args: argparse.Namespace) -> int:
    if not str(args.root).strip():
        raise UserError("--root is empty; name the directory for the store, artifacts and credentials")
    try:
        root = Path(args.root).resolve()
        server = MlflowServer(root, host=args.host, port=args.port, all_interfaces=args.all_interfaces,
                              extra_hosts=tuple(args.allow_host))
        server.check_address()  # a wrong --host is one line before --root is touched
        server.auth_password = credentials(root)
        server.start()
    except OSError as err:  # --root too long, on a read-only filesystem, ...
        raise UserError(f"--root {str(args.root)[:80]!r}: {err.strerror or err}; name a directory you can write") \
            from None
    print(f"tracking server: {server.uri} (MLflow basic auth; store and artifacts in {root})", flush=True)
    if len(server.served) > 1:
        print(f"  also on: {', '.join(server.served[1:])}", flush=True)
    print(f"tracking.uri={server.uri}", flush=True)
    print(f"jobs log to it with:  source {root / CREDENTIALS}; dspark submit CONFIG tracking.uri={server.uri}",
          flush=True)
    proc = server.proc
    assert proc is not None  # start() has launched it
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    while not done.wait(2.0):
        if proc.poll() is not None:
            print(f"error: the MLflow server exited with code {proc.returncode}; see {server.log_path}")
            return 1
    server.stop()
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tracking", help="run the MLflow tracking server the cluster's jobs log to")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    serve = actions.add_parser("serve", help="serve MLflow with basic auth until Ctrl-C", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_argument("--root", default="runs/mlflow-server", help="store, artifacts and credentials")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on; give the node's own address for jobs on other nodes")
    serve.add_argument("--port", type=_port, default=0, help="0: a free port")
    serve.add_argument("--all-interfaces", action="store_true",
                       help="allow --host 0.0.0.0 or :: (every interface, outside ones included)")
    serve.add_argument("--allow-host", action="append", default=[], metavar="NAME", type=_host_name,
                       help="another name clients dial the server by (a DNS alias); repeatable")
    serve.set_defaults(func=run)
