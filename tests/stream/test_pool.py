"""Receive buffers are reused once released, and never while a capture still holds them."""

from __future__ import annotations

import torch

from hpc.stream.protocol import BufferPool
from hpc.stream.sample import Capture


def test_released_buffers_take_the_next_sample_and_held_ones_do_not():
    pool = BufferPool(torch.device("cpu"), max_free=4)
    states, flat = pool.take((10, 4, 8), torch.float32)
    first = pool.lend(Capture.from_states(0, torch.zeros(10), torch.ones(10), states), [flat])
    held, _ = pool.take((10, 4, 8), torch.float32)  # the first is still lent: a new buffer
    assert held.data_ptr() != states.data_ptr() and pool.allocated == 2
    pool.release(first)
    smaller, _ = pool.take((6, 4, 8), torch.float32)  # a shorter sample fits in the freed buffer
    assert smaller.data_ptr() == states.data_ptr() and pool.allocated == 2
    other, _ = pool.take((6, 4, 8), torch.bfloat16)  # never across dtypes
    assert pool.allocated == 3 and other.dtype == torch.bfloat16


def test_the_smallest_fitting_buffer_is_taken_among_several():
    pool = BufferPool(torch.device("cpu"))
    caps = []
    for n in (64, 16, 32):
        t, flat = pool.take((n,), torch.int64)
        caps.append(pool.lend(Capture.from_states(n, torch.zeros(1), torch.ones(1), torch.zeros(1, 2, 1)), [flat]))
    for c in caps:
        pool.release(c)
    t, flat = pool.take((20,), torch.int64)
    assert flat.numel() == 32 and len(pool.free) == 2 and pool.allocated == 3


def test_the_streamers_shares_hold_the_whole_buffer():
    """Credit returns only when a micro-batch is packed: shares rounded down (8 over 3 streamers:
    6) could hold less than the micro-batch the buffer was sized for, and the stream would hang."""
    from types import SimpleNamespace

    from hpc.stream.receiver import StreamReceiver

    planes = SimpleNamespace(device=torch.device("cpu"))
    for capacity, streamers in ((8, 3), (8, 4), (1, 2), (7, 7)):
        r = StreamReceiver(list(range(1, streamers + 1)), capacity, planes)  # type: ignore[arg-type]
        assert capacity <= r.share * streamers < capacity + streamers
