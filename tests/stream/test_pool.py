"""Receive buffers are reused once released, never while a capture still holds them, and the
pool keeps no more buffers than credits let a trainer hold."""

from __future__ import annotations

import torch

from hpc.stream.protocol import BufferPool, carve, sample_bytes
from hpc.stream.sample import Capture


def _cap(i: int) -> Capture:
    return Capture.from_states(i, torch.zeros(1), torch.ones(1), torch.zeros(1, 2, 1))


def test_released_buffers_take_the_next_sample_and_held_ones_do_not():
    pool = BufferPool(torch.device("cpu"), limit=4)
    flat = pool.take(1280)
    first = pool.lend(_cap(0), flat)
    held = pool.take(1280)  # the first is still lent: a new buffer
    assert held.data_ptr() != flat.data_ptr() and pool.allocated == 2
    pool.release(first)
    smaller = pool.take(768)  # a shorter sample fits in the freed buffer
    assert smaller.data_ptr() == flat.data_ptr() and pool.allocated == 2


def test_the_smallest_fitting_buffer_is_taken_among_several():
    pool = BufferPool(torch.device("cpu"))
    caps = [pool.lend(_cap(n), pool.take(n)) for n in (64, 16, 32)]
    for c in caps:
        pool.release(c)
    flat = pool.take(20)
    assert flat.numel() == 32 and len(pool.free) == 2 and pool.allocated == 3


def test_mixed_lengths_never_keep_more_buffers_than_the_limit():
    """The old pool bounded the free buffers alone: beside the lent ones it kept up to its bound
    more, each grown to the longest sample, about twice what credits allow."""
    limit, g = 4, torch.Generator().manual_seed(0)
    pool = BufferPool(torch.device("cpu"), limit=limit)
    lent: list[Capture] = []
    peak_bytes, longest = 0, 0
    for i in range(200):
        n = int(torch.randint(1, 1000, (1,), generator=g))
        longest = max(longest, n)
        lent.append(pool.lend(_cap(i), pool.take(n)))
        if len(lent) == limit or int(torch.randint(0, 2, (1,), generator=g)):
            pool.release(lent.pop(0))
        assert pool.held() <= limit
        peak_bytes = max(peak_bytes, sum(b.numel() for b in pool.free) + sum(b.numel() for b in pool.lent.values()))
    assert peak_bytes <= limit * longest
    for c in lent:
        pool.release(c)
    assert pool.held() <= limit and pool.out == 0


def test_a_step_holding_more_than_the_limit_is_trimmed_back_on_release():
    pool = BufferPool(torch.device("cpu"), limit=2)
    caps = [pool.lend(_cap(i), pool.take(100)) for i in range(5)]  # credits plus a step's micro-batches
    assert pool.held() == 5
    for c in caps:
        pool.release(c)
    assert pool.held() == 2 and pool.allocated == 5


def test_a_slow_trainer_reuses_every_buffer_once_warm():
    """The trainer is behind: every credit is in use while a step packs the micro-batches it
    drew (their credit already went back). A bound of the credits alone dropped and reallocated
    a step's buffers every step; the receiver's bound counts the step's samples too."""
    shares, step = 8, 2

    def steady_allocations(limit: int) -> int:
        pool = BufferPool(torch.device("cpu"), limit=limit)
        queued = [pool.lend(_cap(i), pool.take(256)) for i in range(shares)]
        warm = 0
        for s in range(20):
            if s == 2:
                warm = pool.allocated
            held, queued = queued[:step], queued[step:]  # the step draws its micro-batches: credit back
            queued += [pool.lend(_cap(100 + s), pool.take(256)) for _ in range(step)]  # the streamer refills
            for c in held:  # packed
                pool.release(c)
        return pool.allocated - warm

    assert steady_allocations(shares + step) == 0
    assert steady_allocations(shares) == 18 * step  # what the credits-only bound cost


def test_a_failed_receive_gives_its_buffer_up():
    import pytest

    from hpc.stream.protocol import Header, Kind, recv_sample_body

    pool = BufferPool(torch.device("cpu"), limit=2)
    planes = type("P", (), {"device": torch.device("cpu"), "data": None})()
    with pytest.raises((ValueError, RuntimeError)):  # no process group: the receive itself raises
        recv_sample_body(Header(Kind.SAMPLE, 0, 4, 1, 2, 0, 0), 1, planes, pool)  # type: ignore[arg-type]
    assert pool.out == 0 and pool.held() == 0


def test_one_buffer_carries_ids_and_states_in_their_dtypes():
    T, n_aux, H = 5, 3, 4
    flat = torch.empty(sample_bytes(T, n_aux, H, torch.bfloat16), dtype=torch.uint8)
    ids, states = carve(flat, [((2, T), torch.int64), ((T, n_aux + 1, H), torch.bfloat16)])
    ids.copy_(torch.arange(2 * T).view(2, T))
    states.copy_(torch.full((T, n_aux + 1, H), 1.5))
    assert ids.dtype == torch.int64 and states.dtype == torch.bfloat16
    assert ids.data_ptr() == flat.data_ptr() and states.data_ptr() == flat.data_ptr() + 2 * T * 8
    assert ids.flatten().tolist() == list(range(2 * T)) and bool((states == 1.5).all())


def test_the_streamers_shares_hold_the_whole_buffer():
    """Credit returns only when a micro-batch is packed: shares rounded down (8 over 3 streamers:
    6) could hold less than the micro-batch the buffer was sized for, and the stream would hang."""
    from types import SimpleNamespace

    from hpc.stream.receiver import StreamReceiver

    planes = SimpleNamespace(device=torch.device("cpu"))
    for capacity, streamers in ((8, 3), (8, 4), (1, 2), (7, 7)):
        r = StreamReceiver(list(range(1, streamers + 1)), capacity, planes)  # type: ignore[arg-type]
        assert capacity <= r.share * streamers < capacity + streamers
        assert r.pool.limit == r.share * streamers
    assert StreamReceiver([1, 2], 8, planes, held_per_step=6).pool.limit == 8 + 6  # type: ignore[arg-type]
