"""Where a Slurm task is: job id, node index and the job's hosts, read once from the environment."""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

import psutil

from hpc.errors import UserError
from hpc.launch.slurm import run_slurm


# Kept hand-written (issue 13): submitit.JobEnvironment works only in jobs submitit pickled, not under sbatch/'s srun.
@dataclass
class SlurmEnv:
    job_id: int
    node_index: int
    n_nodes: int
    hostnames: list[str]
    requeue_id: str  # what `scontrol requeue` takes: the array task's own id for arrays
    restart_count: int = 0  # requeues so far: 0 on a job's first attempt

    @classmethod
    def from_environ(cls) -> SlurmEnv:
        env = os.environ
        if "SLURM_JOB_ID" not in env:
            raise UserError("this stage runs inside a Slurm allocation (no SLURM_JOB_ID); use `dspark submit` "
                            "or `dspark train` on one machine")
        nodelist = env.get("SLURM_JOB_NODELIST", env.get("SLURMD_NODENAME", "localhost"))

        try:
            hosts = run_slurm(["scontrol", "show", "hostnames", nodelist]).stdout.split()
        except UserError:  # no scontrol where the task runs (a container image): expand it here
            hosts = expand_hostlist(nodelist)
        array = env.get("SLURM_ARRAY_JOB_ID")
        requeue = f"{array}_{env['SLURM_ARRAY_TASK_ID']}" if array else env["SLURM_JOB_ID"]
        return cls(int(env["SLURM_JOB_ID"]), int(env.get("SLURM_NODEID", 0)), int(env.get("SLURM_NNODES", 1)),
                   hosts, requeue, int(env.get("SLURM_RESTART_COUNT") or 0))


def expand_hostlist(nodelist: str) -> list[str]:
    """Slurm's compressed host list, as `scontrol show hostnames` prints it:
    `gpu[01-02,07],cpu-r[1-2]n1` -> gpu01 gpu02 gpu07 cpu-r1n1 cpu-r2n1."""
    names, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist + ","):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            if nodelist[start:i]:
                names.extend(_expand_one(nodelist[start:i]))
            start = i + 1
    return names


def _expand_one(name: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", name)
    if m is None:
        return [name]
    values = []
    for part in m.group(1).split(","):
        lo, _, hi = part.partition("-")
        if not hi:
            values.append(lo)
            continue
        if not (lo.isdigit() and hi.isdigit()):
            raise UserError(f"cannot expand the host list {name!r}; make scontrol available to the job")
        values += [str(v).zfill(len(lo)) for v in range(int(lo), int(hi) + 1)]
    head, tail = name[: m.start()], name[m.end():]
    return [h for v in values for h in _expand_one(f"{head}{v}{tail}")]


def node_ip(hostname: str) -> str:
    try:
        return socket.gethostbyname(hostname)
    except OSError as err:
        raise UserError(f"cannot resolve node {hostname!r} ({err}); the job needs every node's address") from err


def my_host(env: SlurmEnv) -> str:
    return env.hostnames[env.node_index] if env.node_index < len(env.hostnames) else socket.gethostname()


def advertised_ip(env: SlurmEnv) -> str:
    """The address this node gives the other nodes of its job: the job's own interface.

    Usually its hostname's. But a Debian-style /etc/hosts maps a machine's own name to 127.0.1.1:
    when another node of the job resolves to a real address, the job spans hosts, and the
    interface that routes to that node is the one to advertise. (When every name is loopback,
    as on the dev cluster, the "nodes" are one host and loopback is right.)
    """
    ip = node_ip(my_host(env))
    if not ip.startswith("127."):
        return ip
    others = [a for h in env.hostnames if not (a := node_ip(h)).startswith("127.")]
    if not others:
        return ip
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((others[0], 9))  # no packet is sent: this only asks the routing table
        return probe.getsockname()[0]


def interface_of(ip: str) -> str | None:
    """The network interface that holds `ip` (for GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == ip for a in addrs):
            return name
    return None



def attempt_dir(root: Path, name: str, restart_count: int) -> Path:
    """This job's directory `root/name` (name holds the job id). A first attempt takes a fresh
    one, `name.2`, `name.3`, ... beside an older job's whose id came back (a reset cluster counts
    from 1 again), and creates it; a requeued attempt takes the newest, its first attempt's.
    (A first attempt that died before this call leaves its requeue the old job's directory:
    Slurm hands a job no token that survives a requeue to tell them apart.)"""
    numbered = (re.fullmatch(rf"{re.escape(name)}\.(\d+)", p.name) for p in root.glob(f"{name}.*"))
    taken = [int(m.group(1)) for m in numbered if m] + ([1] if (root / name).exists() else [])
    k = max(1, max(taken, default=0) + (0 if restart_count else 1))
    path = root / (name if k == 1 else f"{name}.{k}")
    if not restart_count:
        path.mkdir(parents=True)
    return path
