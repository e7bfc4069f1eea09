"""Host preparation for the dev cluster: packages, /etc/hosts, and process checks.

Kept apart from hpc_dev/devcluster.py because it is about the machine, not the cluster.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import stat
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import psutil

from hpc.errors import UserError
from hpc.fsio import unsafe_ancestor, write_text

log = logging.getLogger(__name__)

APT_PACKAGES = ("slurmctld", "slurmd", "slurm-client", "slurmdbd", "munge", "mariadb-server", "iproute2")
# Every binary the cluster runs, with the Debian package that ships it (for the error message).
BINARIES = {
    "munged": "munge",
    "munge": "munge",
    "mariadbd": "mariadb-server",
    "mariadb-install-db": "mariadb-server",
    "mariadb": "mariadb-client",
    "mariadb-admin": "mariadb-client",
    "slurmdbd": "slurmdbd",
    "slurmctld": "slurmctld",
    "slurmd": "slurmd",
    "sinfo": "slurm-client",
    "squeue": "slurm-client",
    "scancel": "slurm-client",
    "sacctmgr": "slurm-client",
    "sacct": "slurm-client",
    "scontrol": "slurm-client",
    "sbatch": "slurm-client",
    "srun": "slurm-client",
    "ip": "iproute2",  # the nodes' network namespaces, veths and bridge
    "nsenter": "util-linux",  # a slurmd started inside its node's namespace
}
# Daemons live in sbin, which a non-login shell often lacks.
SEARCH_PATH = os.pathsep.join(
    p for p in [os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin"] if p
)


def process_alive(pid: int) -> bool:
    """True if ``pid`` runs and is not a zombie.

    `kill -0` is not enough: PID 1 on these hosts reaps late and a zombie still answers it.
    """
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:
        return False


def comm_of(pid: int) -> str:
    """The process's name (/proc/PID/comm; psutil completes it from argv only past 15 characters,
    longer than any daemon name we compare it with)."""
    try:
        return psutil.Process(pid).name()
    except psutil.Error:
        return ""


def last_line(path: Path) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    return lines[-1] if lines else "(empty log)"


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b, path=SEARCH_PATH) is None]


@contextlib.contextmanager
def _no_service_starts() -> Iterator[None]:
    """Keep package scripts from starting the system munge/MariaDB: ours run privately."""
    policy = Path("/usr/sbin/policy-rc.d")
    if policy.exists():
        yield
        return
    policy.write_text("#!/bin/sh\n# temporary, written by dspark-dev devcluster\nexit 101\n")
    policy.chmod(0o755)
    try:
        yield
    finally:
        policy.unlink(missing_ok=True)


def can_apt_install() -> bool:
    return (
        os.geteuid() == 0
        and Path("/etc/debian_version").exists()
        and shutil.which("apt-get", path=SEARCH_PATH) is not None
    )


def ensure_installed() -> None:
    """Install Slurm, munge and MariaDB with apt when they are missing and we may."""
    missing = missing_binaries()
    if not missing:
        return
    packages = " ".join(sorted({BINARIES[b] for b in missing}))
    if not can_apt_install():
        raise UserError(
            f"devcluster needs {', '.join(missing)} (apt packages: {packages}); "
            "it installs them itself only when run as root on Debian/Ubuntu"
        )
    log.info("installing %s with apt-get (one-time)", " ".join(APT_PACKAGES))
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive", "PATH": SEARCH_PATH}
    install = ["apt-get", "install", "-y", "--no-install-recommends", *APT_PACKAGES]
    with _no_service_starts():
        done = subprocess.run(install, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            # A fresh image often has no package lists yet.
            subprocess.run(["apt-get", "update"], env=env, capture_output=True, text=True)
            done = subprocess.run(install, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"`{' '.join(install)}` failed: {last}")
    if still := missing_binaries():
        raise UserError(f"apt-get installed {packages} but {', '.join(still)} is still missing")


def ensure_hosts_entries(pairs: Sequence[tuple[str, str]], hosts: Path = Path("/etc/hosts"),
                         state_dir: Path | None = None) -> bool:
    """Every (address, name) must resolve: MASTER_ADDR=node1, srun, gloo, the login name in a tracking
    URI. Names another line already maps to the same address are left to it; one it maps elsewhere
    is refused (the resolver takes the first line). Our own marked lines are rewritten to match.
    True if the file changed; `state_dir` then records it, so that only this cluster's `down`
    takes them out."""
    lines = hosts.read_text().splitlines(keepends=True)
    theirs: dict[str, str] = {}
    for line in lines:
        if HOSTS_MARK not in line and (fields := line.split("#", 1)[0].split()):
            for name in fields[1:]:
                theirs.setdefault(name, fields[0])
    by_addr: dict[str, list[str]] = {}
    for addr, name in pairs:
        if name not in theirs:
            by_addr.setdefault(addr, []).append(name)
        elif theirs[name] != addr:
            raise UserError(f"devcluster: {hosts} maps {name} to {theirs[name]}, the cluster needs {addr}; "
                            f"remove that line (or pass another --subnet) and run `up` again")
    wanted = [f"{addr} {' '.join(names)}  {HOSTS_MARK}\n" for addr, names in by_addr.items()]
    kept = [ln for ln in lines if HOSTS_MARK not in ln]
    if [ln for ln in lines if HOSTS_MARK in ln] == wanted:
        return False
    if kept and not kept[-1].endswith("\n"):
        kept[-1] += "\n"
    hosts.write_text("".join(kept + wanted))  # in place: /etc/hosts is often a bind mount
    if state_dir is not None and wanted:
        write_text(state_dir / HOSTS_ADDED, f"{hosts}\n")
    return True


def remove_own_hosts_entries(state_dir: Path, hosts: Path = Path("/etc/hosts")) -> bool:
    """Take out the hosts line only if this state dir's `up` added it: another dev cluster on the
    host (a test's, say) may be using the same node names."""
    marker = state_dir / HOSTS_ADDED
    if not os.path.lexists(marker):
        return False
    removed = remove_hosts_entries(hosts)
    marker.unlink()
    return removed


# ---- running as root next to other users --------------------------------------------------
# The state directory sits under /var/tmp, where anyone may create it first. Root must then
# not follow links planted inside, nor signal a process that merely carries a daemon's name.

REAL_SLURM_CONFS = (Path("/etc/slurm/slurm.conf"), Path("/etc/slurm-llnl/slurm.conf"))
HOSTS_MARK = "# dspark-devcluster"
HOSTS_ADDED = "hosts-line-added"  # in the state dir: this cluster's `up` wrote the hosts line


STATE_DIR_MODE = 0o711  # munged insists that everyone may traverse to its socket; nobody else lists or writes


def secure_state_dir(root: Path) -> None:
    """`root` as a directory of ours, 0711 and not a link; refuse one someone else made, or one
    under a directory another user could swap it from (root later deletes under it)."""
    if (why := unsafe_ancestor(root.parent)) is not None:
        raise UserError(f"devcluster: {why}; pass --dir a directory under one of your own")
    root.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        root.mkdir(mode=0o700)
    st = os.lstat(root)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UserError(f"devcluster: {root} is not a plain directory (a link?); remove it or pass --dir")
    if st.st_uid != os.geteuid():
        raise UserError(f"devcluster: {root} belongs to uid {st.st_uid}, not to us; someone else created it. "
                        "Remove it (check what is inside first) or pass --dir")
    if stat.S_IMODE(st.st_mode) != STATE_DIR_MODE:
        os.chmod(root, STATE_DIR_MODE)


def fake_device(path: Path) -> None:
    """A character device with /dev/null's numbers (slurmd only needs the file to exist), made
    fresh unless one is there: never chmod through a link someone planted as a "device"."""
    try:
        st = os.lstat(path)
        if stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) == 1 and os.minor(st.st_rdev) == 3:
            return
        path.unlink()
    except FileNotFoundError:
        pass
    os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    os.chmod(path, 0o666)  # mknod honours the umask; lstat above said this is our own node


def daemon_is_ours(pid: int, comm: str, root: Path, slurm_conf: Path) -> bool:
    """The process runs as us, has the daemon's name, and was started for this state dir (its
    command line names the dir, or its SLURM_CONF is ours). A name alone is not enough."""
    try:
        proc = psutil.Process(pid)
        if proc.name() != comm or proc.uids().effective != os.geteuid():
            return False
        cmdline = os.fsencode(" ".join(proc.cmdline()))
        environ = proc.environ()
    except psutil.Error:
        return False
    return _names_path(cmdline, root) or environ.get("SLURM_CONF") == str(slurm_conf)


def _names_path(cmdline: bytes, root: Path) -> bool:
    """`root` appears in the command line as a whole path (or the start of one beneath it): a
    plain substring would take a daemon of `/var/tmp/dspark-devcluster2` for one of ours."""
    here = re.escape(str(root).rstrip("/").encode())
    return re.search(rb"(?:^|[\s=:,])" + here + rb"(?:/|[\s,]|$)", cmdline) is not None


DEVCLUSTER_ENV = "DSPARK_DEVCLUSTER"  # in the environment of every daemon a dev cluster starts


def _started_by_a_devcluster(proc) -> bool:
    """`proc` or one of its ancestors carries DEVCLUSTER_ENV (a slurmd forks short-lived
    children for its RPCs; the daemon itself carries the environment we gave it)."""
    while proc is not None and proc.pid > 1:
        try:
            if DEVCLUSTER_ENV in proc.environ():
                return True
            proc = proc.parent()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return False
    return False


def real_slurm_present() -> str | None:
    """What shows that this host runs a real Slurm (a config in /etc, or Slurm daemons that no
    dev cluster started), or None."""
    for conf in REAL_SLURM_CONFS:
        if conf.exists():
            return str(conf)
    for proc in psutil.process_iter(["name"]):
        if proc.info["name"] in ("slurmctld", "slurmd", "slurmdbd") and process_alive(proc.pid) \
                and not _started_by_a_devcluster(proc):  # a zombie (a daemonising parent) is no daemon
            return f"a {proc.info['name']} (pid {proc.pid}) that this devcluster did not start"
    return None


def remove_hosts_entries(hosts: Path = Path("/etc/hosts")) -> bool:
    """Take out the line `up` added (it carries HOSTS_MARK); True if there was one."""
    try:
        lines = hosts.read_text().splitlines(keepends=True)
    except OSError:
        return False
    kept = [ln for ln in lines if HOSTS_MARK not in ln]
    if len(kept) == len(lines):
        return False
    hosts.write_text("".join(kept))
    return True
