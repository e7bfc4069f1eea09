"""One rank of the order-check tests (spawned, so importable): worlds whose data-plane ops gloo
carries but NCCL would not."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hpc.dist.planes import init_planes
from hpc.dist.rules import Message, message
from hpc.dist.streams import RecvStream


def swapped(rank: int, port: int, matched: bool) -> None:
    """Rank 1 streams two 32-byte messages to rank 0; unless `matched`, rank 0 receives them as
    each other's shape and dtype (gloo moves the bytes; NCCL matches count and type)."""
    torch.set_num_threads(1)
    planes = init_planes(rank, 2, [0], "gloo", torch.device("cpu"), "127.0.0.1", port, "o" * 64, timeout_s=30)
    try:
        with message(Message.SAMPLE):
            if rank == 1:
                dist.send(planes.place(torch.arange(8, dtype=torch.float32)), dst=0, group=planes.data)
                dist.send(planes.place(torch.arange(4, dtype=torch.int64)), dst=0, group=planes.data)
            else:
                first, second = planes.empty(8, dtype=torch.float32), planes.empty(4, dtype=torch.int64)
                with RecvStream(planes.device):
                    for buf in ((first, second) if matched else (second, first)):
                        dist.recv(buf, src=1, group=planes.data)
    finally:
        dist.destroy_process_group()


def partial_batch(rank: int, port: int) -> None:
    """Ranks 0 and 1 open the data plane with batch_isend_irecv; rank 2 is not in that call."""
    torch.set_num_threads(1)
    planes = init_planes(rank, 3, [0, 1], "gloo", torch.device("cpu"), "127.0.0.1", port, "p" * 64, timeout_s=30)
    try:
        if rank < 2:  # one way, as the stream flows: rank 1 -> rank 0
            buf = planes.place(torch.full((4,), float(rank)))
            ops = [dist.P2POp(dist.isend, buf, 0, group=planes.data) if rank == 1 else
                   dist.P2POp(dist.irecv, buf, 1, group=planes.data)]
            with message(Message.SAMPLE), RecvStream(planes.device):
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
        dist.barrier(group=planes.control)
    finally:
        dist.destroy_process_group()
