"""One rank of the stream as it was before the two planes (findings 1 and 2 of the GPU-path issue).

One group carried everything: a receive thread blocked in `recv(peer)` while the control
thread sent credits to that same peer, and the trainers' bookkeeping collectives ran on CPU
tensors in their NCCL group. Gloo runs both; the checker must refuse both.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hpc.dist import rules
from hpc.dist.rules import CHECKER, Message, NCCLRuleError, Plane
from tests.fixtures.wait import wait_until


def main(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rules.install_from_env()
    dist.init_process_group("gloo", rank=rank, world_size=2)
    world = dist.distributed_c10d._get_default_group()
    rules.register(world, Plane.DATA, "cpu")  # the old init_world: one group for all stream traffic
    peer = 1 - rank
    caught: list[str] = []

    def recv_loop() -> None:  # the old _recv_loop, blocked in a sample body's receive
        try:
            with rules.message(Message.SAMPLE):
                dist.recv(torch.zeros(16), src=peer)
        except Exception:  # noqa: BLE001 - the peer exits without sending
            pass

    threading.Thread(target=recv_loop, daemon=True).start()
    wait_until(lambda: CHECKER.owned(world, peer), 30, 0.01, "the receive thread owns the pair")
    try:  # the old _control_loop (trainer) / main loop (streamer): a header to the same peer
        dist.send(torch.zeros(8, dtype=torch.int64), dst=peer)
    except NCCLRuleError as err:
        caught.append(str(err))

    trainers = dist.new_group([0, 1])
    rules.register(trainers, Plane.DATA, "cuda")  # what it is under train.dist_backend=nccl
    try:  # the old failed-flag all_reduce of run_trainer
        dist.all_reduce(torch.tensor([1.0]), op=dist.ReduceOp.MAX, group=trainers)
    except NCCLRuleError as err:
        caught.append(str(err))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(caught))
    # Rank 0 hosts the store the other rank's new_group still reads: it leaves last.
    store = dist.distributed_c10d._get_default_store()
    store.add("finished", 1)
    if rank == 0:
        wait_until(lambda: store.add("finished", 0) == 2, 60, 0.01, "both ranks finished")
    os._exit(0)  # the receive thread is still blocked: skip gloo's teardown
