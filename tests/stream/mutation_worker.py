"""One rank of the receive-stream mutation tests (spawned): rank 0 a trainer's StreamReceiver,
rank 1 a streamer with two samples. `mutation` takes out what hpc.dist.streams keeps honest."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


class _NoStream:
    """The receive thread without its side stream: as the code read before RecvStream existed."""

    def __init__(self, device):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def synchronize(self):
        return None


def main(rank: int, port: int, out: str, mutation: str) -> None:
    torch.set_num_threads(1)
    from hpc.dist.planes import init_planes, open_pairs
    from hpc.dist.streams import RecvStream
    from hpc.stream import receiver as receiver_mod
    from hpc.stream.sample import Capture
    from hpc.stream.streamer import run_streamer

    planes = init_planes(rank, 2, [0], "gloo", torch.device("cpu"), "127.0.0.1", port, "m" * 64, timeout_s=30)
    open_pairs(planes)
    if rank == 1:
        caps = [Capture.from_states(i, torch.arange(8), torch.ones(8, dtype=torch.long), torch.randn(8, 2, 4))
                for i in range(2)]
        run_streamer(lambda ledger, epoch: ((0, i, [], []) for i in range(2)), lambda i, ids, m: caps[i], planes,
                     torch.float32, heartbeat_s=0.5)
        return
    if mutation == "no_side_stream":
        receiver_mod.RecvStream = _NoStream  # type: ignore[misc, assignment]
    elif mutation == "no_sync":
        RecvStream.synchronize = lambda self: None  # type: ignore[method-assign]
    recv = receiver_mod.StreamReceiver([1], 4, planes, peer_timeout_s=20.0).start([], 0, share_ledger=True)
    got = []
    while (item := recv.get()) is not None:
        got.append(item[2].sample_id)
        recv.consumed(item[0])
        recv.release(item[2])
    Path(out, "trainer.json").write_text(json.dumps({"got": got, "error": recv.error}))
    os._exit(0)  # the streamer may still wait for a goodbye that an errored receiver never sends
