"""Host preparation for the dev cluster: packages, /etc/hosts, and process checks.

Kept apart from hpc/launch/devcluster.py because it is about the machine, not the cluster.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

from hpc.errors import UserError

log = logging.getLogger(__name__)

APT_PACKAGES = ("slurmctld", "slurmd", "slurm-client", "slurmdbd", "munge", "mariadb-server")
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
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return False
    return bool(fields) and fields[0] not in {"Z", "X"}


def comm_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
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
    policy.write_text("#!/bin/sh\n# temporary, written by dspark devcluster\nexit 101\n")
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


def ensure_hosts_entries(names: Sequence[str], hosts: Path = Path("/etc/hosts")) -> None:
    """Node names must resolve (MASTER_ADDR=node1 in torch.distributed, srun, gloo)."""
    known: set[str] = set()
    for line in hosts.read_text().splitlines():
        known.update(line.split("#", 1)[0].split()[1:])
    missing = [n for n in names if n not in known]
    if not missing:
        return
    text = hosts.read_text()
    sep = "" if text.endswith("\n") or not text else "\n"
    with hosts.open("a") as fh:
        fh.write(f"{sep}127.0.0.1 {' '.join(missing)}\n")
