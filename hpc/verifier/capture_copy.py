"""Moving captured hidden states out of vLLM's cache: a device-side gather, then an async copy to host.

Shared by the capture connector (inside vLLM's venv: this file is copied next to it, so it
imports only torch) and `scripts/gpu-check`. A Kimi sample is ~1 GB ([20k tokens, 4, 7168]
bf16). Copying it to pageable host memory inside the engine step would stall every request
in the batch for the whole transfer, so:
1. the blocks are gathered into a fresh device tensor (a device-to-device copy: ~1 ms on an
   H200), after which vLLM may reuse the blocks at once;
2. the gathered tensor is copied to a pinned host buffer on a side stream (non-blocking), and
   a CUDA event marks when the host copy is complete; the writer thread waits on the event.
Pinned buffers are pooled: pinning 1 GB costs more than copying it. On CPU, step 1 is the
whole job.
"""

from __future__ import annotations

import threading

import torch


def gather_blocks(cache_bnsH: torch.Tensor, block_ids: list[int], n_tokens: int) -> torch.Tensor:
    """[n_tokens, n_ids, H] rows of these cache blocks ([blocks, n_ids, block_size, H]), on the cache's device.

    One copy (indexing the token-major view), so the blocks are free once it is queued and a
    Kimi sample costs ~1.15 GB of device memory until its host copy is done, not twice that.
    """
    blocks = torch.tensor(block_ids, dtype=torch.long, device=cache_bnsH.device)
    _, n, bs, h = cache_bnsH.shape
    out_bsnH = torch.empty(len(block_ids), bs, n, h, dtype=cache_bnsH.dtype, device=cache_bnsH.device)
    torch.index_select(cache_bnsH.permute(0, 2, 1, 3), 0, blocks, out=out_bsnH)  # token-major, one copy
    return out_bsnH.view(-1, n, h)[:n_tokens]


class PinnedPool:
    """Reusable pinned host buffers (flat, by dtype); a buffer is lent until `give_back`."""

    def __init__(self, max_buffers: int = 4):
        self.free: list[torch.Tensor] = []
        self.lock = threading.Lock()
        self.max_buffers = max_buffers

    def reserve(self, numel: int, dtype: torch.dtype, count: int) -> None:
        """Pin `count` buffers now (at engine start), not inside an engine step."""
        for _ in range(min(count, self.max_buffers)):
            self.give_back(torch.empty(numel, dtype=dtype, pin_memory=True))

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        with self.lock:
            for i, buf in enumerate(self.free):
                if buf.dtype == dtype and buf.numel() >= numel:
                    return self.free.pop(i)
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def give_back(self, buf: torch.Tensor) -> None:
        with self.lock:
            self.free.append(buf)
            self.free.sort(key=lambda b: b.numel())
            del self.free[: max(0, len(self.free) - self.max_buffers)]  # drop the smallest


class HostCopy:
    """An in-flight copy of a device tensor to host; `result()` waits for it."""

    def __init__(self, host: torch.Tensor, event=None, buffer: torch.Tensor | None = None,
                 pool: PinnedPool | None = None):
        self.host, self.event, self.buffer, self.pool = host, event, buffer, pool

    def result(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        return self.host

    def release(self) -> None:
        """The host tensor is no longer needed: its pinned buffer goes back to the pool."""
        if self.pool is not None and self.buffer is not None:
            self.pool.give_back(self.buffer)
            self.buffer = None


class HostCopier:
    """Copies device tensors to host without blocking the caller's stream.

    At most `max_in_flight` copies are pending: each holds its gathered device tensor (~1 GB at
    Kimi size, outside vLLM's memory budget), so past that the caller waits for the oldest.
    """

    def __init__(self, device: torch.device, pinned: bool = True, max_buffers: int = 4, max_in_flight: int = 4):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.pinned = pinned and self.cuda
        self.pool = PinnedPool(max_buffers) if self.pinned else None
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.max_in_flight = max_in_flight
        self.pending: list = []  # events of copies not known to be done, oldest first

    def reserve(self, numel: int, dtype: torch.dtype, count: int) -> None:
        if self.pool is not None:
            self.pool.reserve(numel, dtype, count)

    def copy(self, x: torch.Tensor) -> HostCopy:
        if not self.cuda:
            return HostCopy(x.contiguous())
        if not self.pinned:  # blocking copy to pageable memory: the slow path, kept for comparison
            return HostCopy(x.to("cpu"))
        self.pending = [e for e in self.pending if not e.query()]
        while len(self.pending) >= self.max_in_flight:
            self.pending.pop(0).synchronize()
        assert self.pool is not None and self.stream is not None  # both exist when pinned (CUDA)
        buf = self.pool.take(x.numel(), x.dtype)
        host = buf[: x.numel()].view(x.shape)
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)  # the gather that produced x runs on the caller's stream
        with torch.cuda.stream(self.stream):
            host.copy_(x, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        x.record_stream(self.stream)  # the allocator keeps x until the side stream is done with it
        self.pending.append(event)
        return HostCopy(host, event, buf, self.pool)
