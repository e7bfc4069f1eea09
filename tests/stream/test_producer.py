"""The streamer's capture producer: requests in flight, row order kept, failures skipped."""

from __future__ import annotations

import queue
import threading
import time

from hpc.stream.streamer import StreamerStats, _producer


def run(n_rows: int, concurrency: int, fail: set[int] = frozenset()):
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
        return sample_id

    out: queue.Queue = queue.Queue()
    stats = StreamerStats()
    _producer(((0, i, [i], [1]) for i in range(n_rows)), capture, out, stats, threading.Event(), concurrency)
    items = []
    while (item := out.get()) is not None:
        items.append(item)
    return items, stats, peak[0]


def test_requests_overlap_and_come_out_in_row_order():
    items, stats, peak = run(12, concurrency=4, fail={5})
    assert [cap for _, cap in items] == [i for i in range(12) if i != 5]
    assert stats.failed == 1 and peak == 4


def test_one_in_flight_is_sequential():
    items, _, peak = run(5, concurrency=1)
    assert [cap for _, cap in items] == list(range(5)) and peak == 1
