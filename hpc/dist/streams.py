"""The stream a trainer receives samples on, followed by the checker where no CUDA stream exists.

A trainer's data-plane receives run on a side stream of their own thread. On the default
stream they would queue behind the trainer's compute and DDP's all-reduce wait: a trainer
ahead of the others would then hold its streamer's send, and with it the sample a trainer
behind is waiting for (a cross-rank deadlock). Whatever lands on the side stream must be
waited for before another stream reads it, or the trainer packs a half-received buffer.

On CPU there are no streams and both mistakes pass silently. `RecvStream` is the side stream
on CUDA and a stand-in on CPU; in checked mode (`hpc.dist.rules`) the checker follows it: a
data-plane receive outside a `RecvStream`, or a received buffer handed on (`handoff`) before
its stream was synchronised, is a violation in every CPU test.
"""

from __future__ import annotations

import torch

from hpc.dist import rules


class RecvStream:
    def __init__(self, device: torch.device):
        self.cuda = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._ctx: torch.cuda.StreamContext | None = None

    def __enter__(self) -> RecvStream:
        rules.CHECKER.enter_stream(self)
        if self.cuda is not None:
            ctx = self._ctx = torch.cuda.StreamContext(self.cuda)
            ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
            self._ctx = None
        rules.CHECKER.leave_stream()

    def synchronize(self) -> None:
        """What was received on this stream has landed: another stream may read it."""
        if self.cuda is not None:
            self.cuda.synchronize()
        rules.CHECKER.stream_synced(self)


def handoff(tensors: list[torch.Tensor], what: str) -> None:
    """`tensors` go to another thread (and stream) now: they must not be pending on a receive stream."""
    rules.CHECKER.handoff(tensors, what)
