"""One torch.distributed world, two planes: control over gloo, data over the training backend.

Ranks: trainers [0, T), then one streamer per verifier node [T, T+V). Four groups, created by
every rank in the same order:

| group           | ranks     | backend            | carries                                          |
|-----------------|-----------|--------------------|--------------------------------------------------|
| `data` (world)  | all       | training (NCCL)    | sample tensors (ids, states), streamer -> trainer |
| `control`       | all       | gloo               | headers, credits, heartbeats, STOP, the ledger    |
| `train_data`    | trainers  | training (NCCL)    | DDP gradients                                     |
| `train_control` | trainers  | gloo               | bookkeeping collectives: flags, ledger, metrics   |

With several drafts trained from one stream, `train_data` and `train_control` are per group of
trainers (each draft's DDP world); every rank creates every group's pair, in group order.

Why this split: an NCCL group refuses CPU tensors, and NCCL serialises one pair's sends and
receives on one stream, so a thread blocked in `recv(P)` stalls another thread's `send(P)`.
Control traffic runs both ways and waits for long stretches (credits, heartbeats): it lives
on gloo, where concurrent send and recv with one peer are fine. Sample tensors flow one way,
and each pair is served by one thread per side (the streamer's main thread, the trainer's
receive thread for that streamer). A trainer posts its data receive only after the sample's
header arrived on the control plane, so no NCCL op waits on a peer that has nothing to send
(NCCL's watchdog would abort it). On CPU both backends are gloo, and the same code runs:
`hpc.dist.rules` checks NCCL's rules there.

Sample tensors live on the data plane's device: the rank's GPU under NCCL, the CPU under gloo
(gloo's p2p takes no CUDA tensors, so a GPU run over gloo streams through host memory).

NCCL creates a communicator per (streamer, trainer) pair at the pair's first send. Left to the
first sample, that setup would interleave with DDP's collectives mid-training (and block a
streamer where the watchdog cannot see it): `open_pairs` creates them all up front, in one
order on every rank, before anything else runs. It sends a sample-sized message on each pair
and the trainers all-reduce a DDP bucket's worth, so the buffers and protocols that large
messages use are set up here too, not at the first real sample or step.

Threads that touch CUDA must `set_device` themselves: the current device is per thread.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from hpc.dist import rules
from hpc.dist.rendezvous import check_members, rendezvous_store
from hpc.dist.rules import Plane
from hpc.dist.streams import RecvStream
from hpc.own_env import NCCL_TRACE_PREFIX, set_own
from hpc.errors import UserError


def local_rank() -> int:
    """This process's index on its node: our launcher's LOCAL_RANK, else Slurm's SLURM_LOCALID."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")))


def rank_device(device: str, local: int | None = None, exclusive: bool = False) -> torch.device:
    """`cuda` becomes this rank's own GPU (cuda:LOCAL_RANK), made current; cpu stays cpu.

    `exclusive` (NCCL): no two ranks of a node may share a GPU ("Duplicate GPU detected").
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev

    if not torch.cuda.is_available():
        raise UserError(f"train.device={device} but this node has no CUDA device "
                        f"(host {os.uname().nodename}); use train.device=cpu and dist_backend=gloo")
    if dev.index is None:
        local = local_rank() if local is None else local
        n = torch.cuda.device_count()
        if exclusive and local >= n:
            raise UserError(f"rank with local index {local} on {os.uname().nodename}, which has {n} GPUs: NCCL "
                            "needs one GPU per rank; lower train.ranks_per_node (or ranks on this machine)")
        dev = torch.device("cuda", local % n)
    torch.cuda.set_device(dev)  # before any CUDA op or NCCL call, or every local rank lands on cuda:0
    return dev


def bind_thread(device: torch.device) -> None:
    """In a new thread: make this rank's GPU current (CUDA's current device is per thread)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


@dataclass
class Planes:
    rank: int
    world_size: int
    trainers: list[int]
    device: torch.device  # this rank's data-plane tensors live here (the GPU under NCCL, else CPU)
    data: dist.ProcessGroup | None  # the default group; None = the default group
    control: dist.ProcessGroup
    # NON_GROUP_MEMBER on streamer ranks (torch's functions take it where they take a group)
    train_data: dist.ProcessGroup
    train_control: dist.ProcessGroup
    group: list[int] = field(default_factory=list)  # this trainer's draft's trainer ranks ([] on a streamer)

    def place(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """`t` on the data device (a copy only where it lives elsewhere). Every tensor our code puts
        on the data plane comes from here, `empty` or a `BufferPool`: under the checker, host
        tensors from anywhere else are refused as NCCL refuses them (hpc.dist.rules, rule 3)."""
        return rules.placed(t.to(device=self.device, dtype=dtype or t.dtype))

    def empty(self, *size: int, dtype: torch.dtype) -> torch.Tensor:
        return rules.placed(torch.empty(*size, dtype=dtype, device=self.device))

    @property
    def is_trainer(self) -> bool:
        return self.rank in self.trainers

    @property
    def streamers(self) -> list[int]:
        return [r for r in range(self.world_size) if r not in self.trainers]


def data_device(backend: str, device: torch.device) -> torch.device:
    """Where sample tensors travel: the rank's GPU under NCCL; host memory under gloo."""
    return device if backend == "nccl" else torch.device("cpu")


def flight_recorder_env(log_dir: Path, backend: str) -> None:
    """Before the first NCCL group: async error handling tears a rank down when an op times out,
    and the flight recorder dumps each rank's last collectives to `log_dir`/nccl-trace-rank<N>
    (what `dspark status` names). A site's own settings of these are kept."""
    if backend != "nccl":
        return
    log_dir.mkdir(parents=True, exist_ok=True)
    for name, value in (("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3"), ("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000"),
                        ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1"),
                        ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(log_dir / NCCL_TRACE_PREFIX))):
        set_own(name, value, default=True)


def open_pairs(planes: Planes, sample_bytes: int = 1, bucket_bytes: int = 0) -> None:
    """Create every streamer -> trainer pair on the data plane now, in one order on every rank.

    Streamers send to trainers in ascending order and trainers receive from streamers in
    ascending order, so no pair waits on another; the control barrier then lets training start.
    The calling thread hands each pair over: its receive thread or main loop owns it next.
    `sample_bytes` sizes the message on each pair (the largest sample), `bucket_bytes` the
    trainers' warm-up all-reduce on DDP's group (0: none).
    """
    msg = planes.empty(max(sample_bytes, 1), dtype=torch.uint8).zero_()
    with rules.message(rules.Message.SAMPLE):
        if planes.is_trainer:
            with RecvStream(planes.device) as side:  # as the receive threads will
                for s in planes.streamers:
                    dist.recv(msg, src=s, group=planes.data)
                    rules.handover(planes.data, s)
                side.synchronize()
            if bucket_bytes and len(planes.group) > 1:
                dist.all_reduce(planes.empty(bucket_bytes // 4, dtype=torch.float32).zero_(),
                                group=planes.train_data)
        else:
            for t in planes.trainers:
                dist.send(msg, dst=t, group=planes.data)
                rules.handover(planes.data, t)
    del msg
    if planes.device.type == "cuda":  # a streamer's GPU is shared with the vLLM it starts next
        torch.cuda.empty_cache()
    dist.barrier(group=planes.control)


def broadcast_text(text: str | None, group, src: int = 0) -> str | None:
    """`text` from `src` to every rank of `group` (a gloo group), as tensors: torch's object
    collectives unpickle what a peer sent, and a peer is not trusted with code execution."""
    size = torch.tensor([-1 if text is None else len(text.encode())], dtype=torch.int64)
    dist.broadcast(size, group=group, group_src=src)
    n = int(size.item())
    if n < 0:
        return None
    data = torch.zeros(n, dtype=torch.uint8)
    if text is not None and n:  # the source's bytes; the others receive into zeros
        data = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)
    dist.broadcast(data, group=group, group_src=src)
    return data.numpy().tobytes().decode()


def init_planes(rank: int, world_size: int, trainers: list[int], backend: str, device: torch.device,
                master_addr: str, port: int, secret: str, timeout_s: float = 600.0,
                data_timeout_s: float | None = None, groups: list[list[int]] | None = None) -> Planes:
    """Rendezvous and create the four groups (collective over the whole world).

    `groups`: the trainers of each draft trained from this world's stream (default one, every
    trainer); each gets its own `train_data` and `train_control`.

    `device` is the rank's compute device; the planes' data device follows the backend.
    `secret` is the job's rendezvous secret (hpc.dist.rendezvous): every rank holds the same.
    `timeout_s` bounds the rendezvous and the gloo control groups; `data_timeout_s` (default the
    same) the data plane and DDP's group, where a dead NCCL peer would otherwise hang a rank.
    """
    rules.install_from_env()
    timeout = datetime.timedelta(seconds=timeout_s)
    data_timeout = datetime.timedelta(seconds=data_timeout_s or timeout_s)
    store = rendezvous_store(rank, world_size, master_addr, port, timeout, secret)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=data_timeout)
    if rules.installed():
        rules.begin_world(port, secret, rank)
    control = dist.new_group(list(range(world_size)), backend="gloo", timeout=timeout)
    rules.register(control, Plane.CONTROL, "cpu")
    check_members(secret, rank, world_size, control)  # before any other group trusts the world
    mine: tuple = (dist.GroupMember.NON_GROUP_MEMBER, dist.GroupMember.NON_GROUP_MEMBER, [])
    for members in groups or [list(trainers)]:  # every rank creates every group, in one order
        train_data = dist.new_group(members, timeout=data_timeout)
        train_control = dist.new_group(members, backend="gloo", timeout=timeout)
        rules.register(train_data, Plane.DATA, rules.NCCL_DEVICE)
        rules.register(train_control, Plane.CONTROL, "cpu")
        if rank in members:
            mine = (train_data, train_control, list(members))
    data = dist.distributed_c10d._get_default_group()
    moved = data_device(backend, device)
    rules.register(data, Plane.DATA, rules.NCCL_DEVICE)  # under gloo too: see Planes.place
    return Planes(rank, world_size, list(trainers), moved, data, control, mine[0], mine[1], mine[2])
