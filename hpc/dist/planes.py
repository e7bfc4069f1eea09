"""One torch.distributed world, two planes: control over gloo, data over the training backend.

Ranks: trainers [0, T), then one streamer per verifier node [T, T+V). Four groups, created by
every rank in the same order:

| group           | ranks     | backend            | carries                                          |
|-----------------|-----------|--------------------|--------------------------------------------------|
| `data` (world)  | all       | training (NCCL)    | sample tensors (ids, states), streamer -> trainer |
| `control`       | all       | gloo               | headers, credits, heartbeats, STOP, the ledger    |
| `train_data`    | trainers  | training (NCCL)    | DDP gradients                                     |
| `train_control` | trainers  | gloo               | bookkeeping collectives: flags, ledger, metrics   |

Why this split: an NCCL group refuses CPU tensors, and NCCL serialises one pair's sends and
receives on one stream, so a thread blocked in `recv(P)` stalls another thread's `send(P)`.
Control traffic runs both ways and waits for long stretches (credits, heartbeats): it lives
on gloo, where concurrent send and recv with one peer are fine. Sample tensors flow one way,
and each pair is served by one thread per side (the streamer's main thread, the trainer's
receive thread for that streamer). A trainer posts its data receive only after the sample's
header arrived on the control plane, so no NCCL op waits on a peer that has nothing to send
(NCCL's watchdog would abort it). On CPU both backends are gloo, and the same code runs:
`hpc.dist.rules` checks NCCL's rules there.

Threads that touch CUDA must `set_device` themselves: the current device is per thread.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hpc.dist import rules
from hpc.dist.rules import Plane


def local_rank() -> int:
    """This process's index on its node: our launcher's LOCAL_RANK, else Slurm's SLURM_LOCALID."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")))


def rank_device(device: str, local: int | None = None) -> torch.device:
    """`cuda` becomes this rank's own GPU (cuda:LOCAL_RANK), made current; cpu stays cpu."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    from hpc.errors import UserError

    if not torch.cuda.is_available():
        raise UserError(f"train.device={device} but this node has no CUDA device "
                        f"(host {os.uname().nodename}); use train.device=cpu and dist_backend=gloo")
    if dev.index is None:
        dev = torch.device("cuda", (local_rank() if local is None else local) % torch.cuda.device_count())
    torch.cuda.set_device(dev)  # before any CUDA op or NCCL call, or every local rank lands on cuda:0
    return dev


def bind_thread(device: torch.device) -> None:
    """In a new thread: make this rank's GPU current (CUDA's current device is per thread)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


@dataclass
class Planes:
    rank: int
    trainers: list[int]
    device: torch.device  # this rank's data-plane tensors live here
    data: object | None  # the default group; None = the default group
    control: object
    train_data: object  # NON_GROUP_MEMBER on streamer ranks
    train_control: object

    @property
    def is_trainer(self) -> bool:
        return self.rank in self.trainers


def init_planes(rank: int, world_size: int, trainers: list[int], backend: str, device: torch.device,
                master_addr: str, port: int, timeout_s: float = 600.0) -> Planes:
    """Rendezvous and create the four groups (collective over the whole world)."""
    rules.install_from_env()
    os.environ.setdefault("MASTER_ADDR", master_addr)
    os.environ.setdefault("MASTER_PORT", str(port))
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
    control = dist.new_group(list(range(world_size)), backend="gloo", timeout=timeout)
    train_data = dist.new_group(trainers, timeout=timeout)
    train_control = dist.new_group(trainers, backend="gloo", timeout=timeout)
    data = dist.distributed_c10d._get_default_group()
    rules.register(data, Plane.DATA, device.type)
    rules.register(train_data, Plane.DATA, device.type)
    rules.register(control, Plane.CONTROL, "cpu")
    rules.register(train_control, Plane.CONTROL, "cpu")
    return Planes(rank, list(trainers), device, data, control, train_data, train_control)
