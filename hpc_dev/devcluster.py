"""A real multi-node Slurm cluster on this one host, for development and tests.

`DevCluster(state_dir).up()` starts, all under one private state directory: munged, MariaDB,
slurmdbd, slurmctld and one `slurmd -N nodeN` per node (Debian's slurmd supports several on one
host, each on its own port). Clients only need ``SLURM_CONF`` (see :meth:`DevCluster.env`).

Each node is a host of its own: its slurmd, and so every job step it starts, runs in a network
namespace with its own address on a private bridge, whose host side is the login node
(hpc_dev/devcluster_net.py). `network="loopback"` is the fallback for machines where
namespaces cannot be made: every node on 127.0.0.1.

Every fresh start wipes the controller state and the accounting database, so job ids restart
at 1 and no job from an earlier session can resurface. There is no systemd here: daemons are
started detached by hand and stopped by their pid files.

It runs as root next to other users, so (hpc_dev.devcluster_host): the state directory must
be ours and not a link (0711: munged needs others to traverse it, nobody else lists or writes);
files in it are opened without following links; a pid counts as our daemon only if it runs as
us, has the daemon's name and was started for this state dir; no Slurm client runs against a
conf we did not write; a host with a real Slurm is refused without --force; and `down` takes
out the /etc/hosts line `up` added.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from hpc.errors import UserError
from hpc.fsio import write_text
from hpc_dev.devcluster_conf import (
    ACCOUNTING_DB,
    DevClusterSpec,
    render_gres_conf,
    render_slurm_conf,
    render_slurmdbd_conf,
)
from hpc_dev.devcluster_host import (
    DEVCLUSTER_ENV,
    SEARCH_PATH,
    daemon_is_ours,
    ensure_hosts_entries,
    ensure_installed,
    fake_device,
    last_line,
    process_alive,
    real_slurm_present,
    remove_own_hosts_entries,
    secure_state_dir,
)
from hpc_dev.devcluster_net import LOGIN_NAME, default_subnet

log = logging.getLogger(__name__)

DEFAULT_DIR = Path("/var/tmp/dspark-devcluster")
NETWORK_MADE = "network-made"  # in the state dir: this cluster's `up` made the namespaces and bridge
# Start order; one slurmd per node follows them.
CORE_DAEMONS = ("munged", "mariadbd", "slurmdbd", "slurmctld")
# Node states that mean "slurmd registered and answers"; a fresh start waits for all idle.
LIVE_NODE_STATES = {"idle", "mixed", "allocated", "completing"}


def default_state_dir() -> Path:
    return Path(os.environ.get("DSPARK_DEVCLUSTER_DIR") or DEFAULT_DIR)


@dataclass(frozen=True)
class Daemon:
    name: str
    # Expected /proc/PID/comm: a stale pid file must never make us signal a recycled pid.
    comm: str
    pid_file: Path


class DevCluster:
    """One local cluster; all methods are idempotent and serialised by a lock in the state dir."""

    def __init__(
        self,
        state_dir: Path | str | None = None,
        *,
        partition: str = "debug",
        num_nodes: int = 3,
        timeout_s: float = 60.0,
        network: str = "netns",
        subnet: str | None = None,
    ) -> None:
        root = Path(state_dir) if state_dir else default_state_dir()
        self.spec = DevClusterSpec(root=root.absolute(), partition=partition, num_nodes=num_nodes,
                                   network=network, subnet=subnet or default_subnet())
        self.timeout_s = timeout_s

    # ---- what clients need ------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """Environment every Slurm client call (sbatch, sacct, submitit) needs."""
        return {"SLURM_CONF": str(self.spec.slurm_conf)}

    @property
    def partition(self) -> str:
        return self.spec.partition

    @property
    def login_addr(self) -> str:
        """The login side's address on the cluster network: bind servers the nodes dial here."""
        return self.spec.login_addr

    def node_addrs(self) -> dict[str, str]:
        return {n: self.spec.node_addr(n) for n in self.spec.node_names}

    # ---- inspection --------------------------------------------------------------------------

    def daemons(self) -> list[Daemon]:
        """In start order. Includes slurmds left from a run with more nodes, so down() gets them."""
        s = self.spec
        fixed = [Daemon(n, n, s.pid_file(n)) for n in CORE_DAEMONS]
        pid_files = {s.run_dir / f"slurmd-{n}.pid" for n in s.node_names}
        pid_files |= set(s.run_dir.glob("slurmd-*.pid")) if s.run_dir.is_dir() else set()
        slurmds = [Daemon(p.stem, "slurmd", p) for p in sorted(pid_files)]
        return fixed + slurmds

    def pids(self) -> dict[str, int | None]:
        return {d.name: self._running_pid(d) for d in self.daemons()}

    def node_states(self) -> dict[str, str]:
        """Node name -> Slurm state; empty if slurmctld does not answer."""
        if not self.spec.slurm_conf.exists():
            return {}
        argv = ["sinfo", "-h", "-N", "-p", self.spec.partition, "-o", "%N %T"]
        res = self._run(argv, check=False)
        if res.returncode != 0:
            return {}
        return dict(line.split(None, 1) for line in res.stdout.splitlines() if " " in line)

    def is_healthy(self) -> bool:
        s = self.spec
        pids = self.pids()
        expected = [*CORE_DAEMONS, *(f"slurmd-{n}" for n in s.node_names)]
        if not all(pids.get(name) for name in expected) or not self._configs_current():
            return False
        if s.isolated and not s.net.is_up():
            return False
        states = self.node_states()
        return sorted(states) == sorted(s.node_names) and set(states.values()) <= LIVE_NODE_STATES

    def status_text(self) -> str:
        s = self.spec
        lines = [f"devcluster at {s.root}: cluster {s.cluster_name}, partition {s.partition}, "
                 f"{s.num_nodes} node(s)"]
        where = f"network {s.subnet}, a namespace per node" if s.isolated else "loopback (one address)"
        lines.append(f"  {'login':<14} {s.login_addr:<15} {LOGIN_NAME}  ({where})")
        for node in s.node_names:
            lines.append(f"  {node:<14} {s.node_addr(node):<15} namespace {s.net.netns(node)}" if s.isolated
                         else f"  {node:<14} {s.node_addr(node)}")
        pids = self.pids()
        for name, pid in pids.items():
            lines.append(f"  {name:<14} {'running, pid ' + str(pid) if pid else 'stopped'}")
        sinfo = "sinfo: slurmctld is not answering"
        if pids.get("slurmctld"):
            res = self._run(["sinfo", "-N", "-o", "%N %P %T %C %G"], check=False)
            if res.returncode == 0:
                sinfo = res.stdout.rstrip()
        lines.append(sinfo)
        lines.append(f"export SLURM_CONF={s.slurm_conf}")
        return "\n".join(lines)

    # ---- lifecycle ---------------------------------------------------------------------------

    def up(self, force: bool = False) -> bool:
        """Bring the cluster up; returns False if it already was (then this is cheap).

        Refuses a host with a real Slurm (unless `force`): this installs packages, starts
        daemons as root and edits /etc/hosts, which belongs on test machines only."""
        if problems := self.spec.check():
            raise UserError("; ".join(problems))
        if not force and (real := real_slurm_present()):
            raise UserError(f"devcluster: this host has a real Slurm ({real}); the dev cluster is for test "
                            "machines. Pass --force to start it anyway")
        ensure_installed()
        if os.geteuid() != 0:
            raise UserError("devcluster must run as root: slurmd and SlurmUser=root need it")
        if self.spec.isolated:
            self.spec.net.check_free()  # before anything running is stopped
        with self._locked():
            if self.is_healthy():
                return False
            # Half-up is not worth repairing: a fresh start takes a few seconds and is predictable.
            # The network is the exception: `up` keeps what is right (a server may be bound to it).
            self._stop_all()
            self._network_up()
            self._write_files()
            ensure_hosts_entries(self.spec.hosts_lines(), state_dir=self.spec.root)
            self._start_munged()
            self._start_mariadb()
            self._start_slurmdbd()
            self._start_slurmctld()
            self._start_slurmds()
            return True

    def up_network(self) -> str:
        """The network alone (no daemons), for a server the nodes must reach before or without the
        cluster (the tests' tracking server); returns the login address. Idempotent."""
        if problems := self.spec.check():
            raise UserError("; ".join(problems))
        with self._locked():
            self._network_up()
            ensure_hosts_entries(self.spec.hosts_lines(), state_dir=self.spec.root)
        return self.spec.login_addr

    def down(self, keep_network: bool = False) -> bool:
        """Stop every daemon, then remove the namespaces, veths and bridge and the /etc/hosts lines
        `up` added (after a crash too); False if nothing ran. `keep_network` leaves the network and
        its names for servers still bound to it (a test session's other worker)."""
        with self._locked():
            stopped = self._stop_all()
            if not keep_network and os.path.lexists(marker := self.spec.root / NETWORK_MADE):
                # Only the state dir that made it: the network is the host's, like /etc/hosts, and
                # another dev cluster (a test's own state dir) going down must not cut the live one's.
                stopped = self.spec.net.down() or stopped
                marker.unlink()
        if not keep_network:
            remove_own_hosts_entries(self.spec.root)
        return stopped

    def _network_up(self) -> None:
        """The namespaces and bridge (or, for the loopback fallback, none: the other mode's would hold
        the node names' addresses); the state dir records that it made them, for `down`."""
        if self.spec.isolated:
            self.spec.net.up()
            write_text(self.spec.root / NETWORK_MADE, f"{self.spec.subnet}\n")
        elif os.path.lexists(self.spec.root / NETWORK_MADE):
            self.spec.net.down()
            (self.spec.root / NETWORK_MADE).unlink()

    # ---- internals ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        secure_state_dir(self.spec.root)  # ours, 0700, no link: nothing below can be planted
        # Python opens files non-inheritable, so daemons started under the lock do not keep it.
        fd = os.open(self.spec.root / "lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            yield

    def _env(self, **extra: str) -> dict[str, str]:
        # An outer job's SLURM_* variables would point our clients at the wrong job or cluster.
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        return {**env, "PATH": SEARCH_PATH, **self.env(), DEVCLUSTER_ENV: str(self.spec.root), **extra}

    def _run(
        self, argv: Sequence[str], *, check: bool = True, timeout: float = 30.0
    ) -> subprocess.CompletedProcess[str]:
        try:
            res = subprocess.run(
                list(argv), env=self._env(), capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            res = subprocess.CompletedProcess(list(argv), 124, "", f"timed out after {timeout} s")
        except FileNotFoundError:
            # Before the packages are installed, inspection just reports "not running".
            res = subprocess.CompletedProcess(list(argv), 127, "", f"{argv[0]}: not installed")
        if check and res.returncode != 0:
            last = (res.stderr.strip().splitlines() or ["no output"])[-1]
            raise UserError(f"devcluster: `{' '.join(argv)}` failed: {last}")
        return res

    def _ok(self, argv: Sequence[str]) -> bool:
        return self._run(argv, check=False, timeout=10).returncode == 0

    def _running_pid(self, daemon: Daemon) -> int | None:
        try:
            pid = int(daemon.pid_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        ours = process_alive(pid) and daemon_is_ours(pid, daemon.comm, self.spec.root, self.spec.slurm_conf)
        return pid if ours else None

    def _configs_current(self) -> bool:
        s = self.spec
        for path, text in (
            (s.slurm_conf, render_slurm_conf(s)),
            (s.slurmdbd_conf, render_slurmdbd_conf(s)),
            (s.gres_conf, render_gres_conf(s)),
        ):
            try:
                if path.read_text() != text:
                    return False
            except OSError:
                return False
        return True

    def _write_files(self) -> None:
        s = self.spec
        for d in (s.etc_dir, s.run_dir, s.log_dir, s.munge_dir, s.spool_dir, s.gpu_dir):
            d.mkdir(parents=True, exist_ok=True)
            # munged refuses a socket dir that is not 755 and logs in group-writable dirs.
            d.chmod(0o755)
        write_text(s.slurm_conf, render_slurm_conf(s))
        write_text(s.gres_conf, render_gres_conf(s))  # temp + rename: a planted link is replaced
        # slurmdbd refuses a readable slurmdbd.conf (it may hold a DB password).
        write_text(s.slurmdbd_conf, render_slurmdbd_conf(s), mode=0o600)
        for i in range(s.gpus_per_node):
            fake_device(s.gpu_dir / f"gpu{i}")

    def _launch(self, name: str, argv: Sequence[str], **extra_env: str) -> None:
        """Start a daemon detached: own session, no inherited fds, output to a log file."""
        out_path = self.spec.log_dir / f"{name}.out"
        with open(out_path, "ab") as out:
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self._env(**extra_env),
                cwd=self.spec.root,
                start_new_session=True,
                close_fds=True,
            )
        try:
            rc = proc.wait(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = -1
        if rc != 0:
            raise UserError(
                f"{name} failed to start (exit {rc}): {last_line(out_path)} (see {out_path})"
            )

    def _wait(self, what: str, ready: Callable[[], bool], log_file: Path) -> None:
        deadline = time.monotonic() + self.timeout_s
        delay = 0.05
        while not ready():
            if time.monotonic() > deadline:
                raise UserError(
                    f"{what} not ready after {self.timeout_s:.0f} s; "
                    f"{log_file}: {last_line(log_file)}"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    def _start_munged(self) -> None:
        s = self.spec
        if not s.munge_key.exists():
            fd = os.open(s.munge_key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as fh:
                fh.write(os.urandom(1024))
        self._launch("munged", [
            "munged",
            f"--socket={s.munge_socket}",
            f"--pid-file={s.pid_file('munged')}",
            f"--key-file={s.munge_key}",
            f"--log-file={s.log_file('munged')}",
            f"--seed-file={s.munge_dir / 'munged.seed'}",
        ])
        self._wait("munged", lambda: self._ok(["munge", "-n", "-S", str(s.munge_socket)]),
                   s.log_file("munged"))

    def _start_mariadb(self) -> None:
        s = self.spec
        if not (s.db_dir / "mysql").is_dir():
            shutil.rmtree(s.db_dir, ignore_errors=True)  # a half-finished earlier install
            self._run([
                "mariadb-install-db", "--no-defaults", "--user=root", f"--datadir={s.db_dir}",
                "--auth-root-authentication-method=socket", "--skip-test-db",
            ], timeout=180)
        sock = f"--socket={s.db_socket}"
        # mariadbd stays in the foreground; `setsid --fork` detaches it so nobody must reap it.
        self._launch("mariadbd", [
            "setsid", "--fork", "mariadbd", "--no-defaults", "--user=root", f"--datadir={s.db_dir}",
            sock, f"--pid-file={s.pid_file('mariadbd')}", "--skip-networking",
            f"--log-error={s.log_file('mariadbd')}",
        ])
        self._wait("mariadbd", lambda: self._ok(["mariadb-admin", "--no-defaults", sock, "ping"]),
                   s.log_file("mariadbd"))
        # A fresh accounting DB keeps job ids (and sacct answers) in step with the fresh controller.
        drop = f"DROP DATABASE IF EXISTS {ACCOUNTING_DB}"
        self._run(["mariadb", "--no-defaults", sock, "-e", drop])

    def _start_slurmdbd(self) -> None:
        s = self.spec
        self._launch("slurmdbd", ["slurmdbd"], MYSQL_UNIX_PORT=str(s.db_socket))
        self._wait("slurmdbd", lambda: self._ok(["sacctmgr", "-n", "list", "cluster"]),
                   s.log_file("slurmdbd"))

    def _start_slurmctld(self) -> None:
        s = self.spec
        shutil.rmtree(s.ctld_state_dir, ignore_errors=True)
        s.ctld_state_dir.mkdir(mode=0o755)
        self._launch("slurmctld", ["slurmctld"])
        self._wait("slurmctld", lambda: self._ok(["scontrol", "ping"]), s.log_file("slurmctld"))

    def _start_slurmds(self) -> None:
        s = self.spec
        for name in s.node_names:
            spool = s.spool_dir / name
            shutil.rmtree(spool, ignore_errors=True)
            spool.mkdir(mode=0o755)
            # In the node's namespace: every job step it starts inherits the node's address.
            prefix = s.net.exec_prefix(name) if s.isolated else []
            self._launch(f"slurmd-{name}", [*prefix, "slurmd", "-N", name])

        def all_idle() -> bool:
            states = self.node_states()
            return sorted(states) == sorted(s.node_names) and set(states.values()) == {"idle"}

        first_log = s.log_dir / f"slurmd-{s.node_names[0]}.log"
        self._wait(f"nodes {','.join(s.node_names)} (idle)", all_idle, first_log)

    def _stop_all(self) -> bool:
        daemons = self.daemons()
        pids = {d.name: self._running_pid(d) for d in daemons}
        # Only against our own controller: a client call with a conf we did not write could
        # reach a real cluster.
        if pids.get("slurmctld") and any(pids.get(d.name) for d in daemons if d.comm == "slurmd") \
                and self._configs_current():
            self._cancel_jobs()
        for d in reversed(daemons):
            if (pid := pids[d.name]) is not None:
                log.info("stopping %s (pid %d)", d.name, pid)
                self._terminate(pid)
            d.pid_file.unlink(missing_ok=True)
        return any(pids.values())

    def _cancel_jobs(self) -> None:
        """Job steps outlive a stopped slurmd; cancel them while the cluster can still do it."""
        res = self._run(["squeue", "-h", "-o", "%A"], check=False)
        ids = res.stdout.split() if res.returncode == 0 else []
        if not ids:
            return
        self._run(["scancel", "--full", *ids], check=False)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            left = self._run(["squeue", "-h", "-t", "running,completing", "-o", "%A"], check=False)
            if left.returncode != 0 or not left.stdout.strip():
                return
            time.sleep(0.5)

    @staticmethod
    def _terminate(pid: int, grace_s: float = 20.0) -> None:
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                if not process_alive(pid):
                    return
                time.sleep(0.05)
        raise UserError(f"process {pid} survived SIGKILL; stop it by hand")
