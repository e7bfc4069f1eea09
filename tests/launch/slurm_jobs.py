"""Tiny functions that the dev-cluster tests run as real Slurm jobs through submitit.

The tests register this module with cloudpickle by value, so the job's Python does not need
`tests` on its path; keep imports inside the functions light and standard.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def timed_square(x: int, sleep_s: float) -> tuple[int, float, float]:
    """Returns x*x with the wall-clock interval the task was running, to measure overlap."""
    start = time.time()
    time.sleep(sleep_s)
    return x * x, start, time.time()


def gloo_all_reduce() -> dict[str, object]:
    """One rank of a multi-node job: all_reduce(rank + 1) over gloo, plus where it ran."""
    from datetime import timedelta

    import submitit
    import torch
    import torch.distributed as dist

    from hpc.launch.slurm_env import SlurmEnv, advertised_ip, interface_of

    # The dev cluster has fake GPUs only; leave CUDA_VISIBLE_DEVICES to Slurm.
    env = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    # Each node is a host of its own: gloo otherwise takes the machine name's address (loopback
    # here, as on many clusters) and the other node dials its own loopback. What a real cluster
    # needs too, and what `dspark`'s stages do (hpc/launch/stages.py).
    mine = advertised_ip(SlurmEnv.from_environ())
    os.environ["GLOO_SOCKET_IFNAME"] = interface_of(mine) or ""
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        value = torch.tensor([float(env.rank + 1)])
        dist.all_reduce(value)
        return {
            "rank": env.rank,
            "world_size": env.world_size,
            "master_addr": env.master_addr,
            "node": os.environ["SLURMD_NODENAME"],
            "addr": mine,
            "node_id": int(os.environ["SLURM_NODEID"]),
            "value": value.item(),
        }
    finally:
        dist.destroy_process_group()


def fail(message: str) -> None:
    raise RuntimeError(message)


def touch(path: str) -> str:
    Path(path).write_text(os.environ.get("SLURM_JOB_ID", "?"))
    return path
