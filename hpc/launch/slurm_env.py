"""Where a Slurm task is: job id, node index and the job's hosts, read once from the environment."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass

from hpc.errors import UserError


@dataclass
class SlurmEnv:
    job_id: int
    node_index: int
    n_nodes: int
    hostnames: list[str]
    requeue_id: str  # what `scontrol requeue` takes: the array task's own id for arrays

    @classmethod
    def from_environ(cls) -> "SlurmEnv":
        env = os.environ
        if "SLURM_JOB_ID" not in env:
            raise UserError("this stage runs inside a Slurm allocation (no SLURM_JOB_ID); use `dspark submit` "
                            "or `dspark train` on one machine")
        nodelist = env.get("SLURM_JOB_NODELIST", env.get("SLURMD_NODENAME", "localhost"))
        try:
            hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                                   timeout=30, check=True).stdout.split()
        except (OSError, subprocess.SubprocessError):
            hosts = [nodelist]
        array = env.get("SLURM_ARRAY_JOB_ID")
        requeue = f"{array}_{env['SLURM_ARRAY_TASK_ID']}" if array else env["SLURM_JOB_ID"]
        return cls(int(env["SLURM_JOB_ID"]), int(env.get("SLURM_NODEID", 0)), int(env.get("SLURM_NNODES", 1)),
                   hosts, requeue)


def rendezvous_port(job_id: int, base: int = 20000, span: int = 20000) -> int:
    """Derived from the job id: every rank computes it alone, and two jobs sharing a node differ."""
    return base + job_id % span
