"""The streamer's capture producer: requests in flight, row order kept, failures skipped."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from hpc.errors import UserError, VerifierDown
from hpc.stream.protocol import Failure
from hpc.stream.streamer import MAX_CONSECUTIVE_FAILURES, StreamerStats, _producer


def run(n_rows: int, concurrency: int, fail: set[int] = frozenset(), down_at: int | None = None,
        start_error: Exception | None = None):
    live, peak, lock = [0], [0], threading.Lock()

    def capture(sample_id, ids, mask):
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        time.sleep(0.02 if sample_id % 2 else 0.05)  # uneven: later requests finish first
        with lock:
            live[0] -= 1
        if sample_id in fail:
            raise ValueError("corrupt capture file")
        if down_at is not None and sample_id >= down_at:
            raise VerifierDown("vLLM exited with code -9")
        return sample_id

    def start():
        if start_error is not None:
            raise start_error
        return capture

    out: queue.Queue = queue.Queue()
    stats = StreamerStats()
    _producer(((0, i, [i], [1]) for i in range(n_rows)), start, out, stats, threading.Event(), concurrency)
    items = []
    while (item := out.get()) is not None:
        items.append(item)
    return items, stats, peak[0]


def captured(items) -> list:
    return [cap for _, _, cap in items if cap is not None]


def test_requests_overlap_and_come_out_in_row_order():
    items, stats, peak = run(12, concurrency=4, fail={5})
    assert captured(items) == [i for i in range(12) if i != 5]
    assert stats.failed == 1 and peak == 4
    # The failed sample is handed on as a skip, in its place: the trainers' ledger must hear of it.
    assert items[5] == (0, 5, None)


def test_one_in_flight_is_sequential():
    items, _, peak = run(5, concurrency=1)
    assert captured(items) == list(range(5)) and peak == 1


@pytest.mark.parametrize("concurrency", [1, 4])
def test_a_dead_verifier_ends_the_stream_and_is_not_a_bad_sample(concurrency):
    items, stats, _ = run(50, concurrency, down_at=7)
    assert items == [(0, i, i) for i in range(7)]  # everything before, nothing after; no skip
    assert stats.failed == 0 and stats.failure == Failure.DIED and "exited with code -9" in stats.fatal


def test_a_verifier_that_never_starts_ends_the_stream_at_once():
    items, stats, _ = run(50, 1, start_error=UserError("vLLM exited with code 1 before it was healthy"))
    assert items == [] and stats.failure == Failure.NOT_STARTED and "did not start" in stats.fatal


def test_bad_samples_on_a_live_verifier_are_skipped_until_a_streak():
    items, stats, _ = run(MAX_CONSECUTIVE_FAILURES + 5, 1, fail=set(range(MAX_CONSECUTIVE_FAILURES + 5)))
    assert captured(items) == [] and stats.failed == MAX_CONSECUTIVE_FAILURES and stats.failure == Failure.BAD_SAMPLES
    assert [i for _, i, _ in items] == list(range(MAX_CONSECUTIVE_FAILURES - 1))  # the streak's last ends it
