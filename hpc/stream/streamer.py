"""The streamer: one process per verifier node, pushing captures to trainer ranks.

It asks its verifier backend for captures in a prefetch thread (the verifier's forward never
waits on the network), and sends each capture to the trainer that has granted it the most
credits, i.e. the least-loaded one from this streamer's view. Trainers grant credits only for
free buffer slots, which bounds what is in flight (backpressure). The trainer's ledger,
received at start, lists sample ids already trained this epoch: they are skipped, so a
restart neither repeats nor drops a sample.

The verifier starts inside the stream (`start_capture`), after the world has formed: while it
loads, heartbeats keep the trainers waiting, and if it never gets healthy the trainers hear
FAILED within seconds instead of waiting out a rendezvous timeout. A capture that fails
because the verifier is gone or hung (VerifierDown) is not a bad sample: the streamer ends
the stream with FAILED, so the trainers checkpoint and exit with the peer-died code rather
than finish a short run and export it.

When several drafts share the stream (`groups`), one group's failure is that group's alone: a
trainer whose control channel fails (killed, OOM) drops its whole group from the stream, in one
line naming the variant, and the others go on; STOP then goes to the live groups only. On gloo
a send to a dead peer fails at once. (On NCCL it would wait for the watchdog: the drop must be
seen on the gloo control plane, which fails first, before a data send is posted to that group.)
"""

from __future__ import annotations

import queue
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from hpc.dist.planes import Planes
from hpc.errors import VerifierDown
from hpc.stream.protocol import Failure, Header, Kind, recv_header, recv_ledger, sample_bytes
from hpc.stream.sample import Capture
from hpc.stream.sender import SampleSender

CaptureFn = Callable[[int, list[int], list[int]], Capture]


@dataclass
class StreamerStats:
    sent: int = 0
    skipped: int = 0  # already in the ledger
    failed: int = 0  # capture errors (e.g. a corrupt capture file): that sample only
    bytes: int = 0
    per_trainer: dict[int, int] = field(default_factory=dict)
    wait_credit_s: float = 0.0
    fatal: str | None = None  # the verifier is gone: the stream ends early, with FAILED
    failure: Failure | None = None
    sender: SampleSender | None = None  # its peak staging memory is what `bench stream` reports
    dropped: dict[int, str] = field(default_factory=dict)  # group -> why it left the stream (several drafts)


MAX_CONSECUTIVE_FAILURES = 20  # more in a row means the verifier itself is gone, not one bad file


def _producer(rows: Iterable[tuple[int, int, list[int], list[int]]], start: Callable[[], CaptureFn],
              out: queue.Queue, stats: StreamerStats, stop: threading.Event, concurrency: int = 1) -> None:
    """Start the verifier, then capture with `concurrency` requests in flight (so vLLM batches
    prefills), handed on in row order."""
    try:
        capture = start()
    except Exception as err:  # noqa: BLE001 - any start failure ends the stream, named
        stats.fatal, stats.failure = f"the verifier did not start: {str(err).splitlines()[0]}", Failure.NOT_STARTED
        print(f"streamer: {stats.fatal}", flush=True)
        _put(out, None, stop)
        return
    if concurrency > 1:
        with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="capture") as pool:
            _produce(rows, lambda *a: pool.submit(capture, *a), out, stats, stop, concurrency)
    else:  # one in flight: capture in this thread, no hand-off to a worker and back per sample
        _produce(rows, lambda *a: _done(capture, *a), out, stats, stop, 1)


def _done(fn, *args) -> Future:
    future: Future = Future()
    try:
        future.set_result(fn(*args))
    except Exception as err:  # noqa: BLE001 - delivered where the result is read, as from a pool
        future.set_exception(err)
    return future


def _produce(rows, submit, out: queue.Queue, stats: StreamerStats, stop: threading.Event, concurrency: int) -> None:
    streak = 0
    pending: deque = deque()  # (epoch, sample id, future), oldest first
    rows = iter(rows)
    while True:
        while len(pending) < concurrency and not stop.is_set():
            row = next(rows, None)
            if row is None:
                break
            epoch, sample_id, ids, mask = row
            pending.append((epoch, sample_id, submit(sample_id, ids, mask)))
        if not pending or stop.is_set():
            break
        epoch, sample_id, future = pending.popleft()
        try:
            cap = future.result()
        except VerifierDown as err:
            if not stop.is_set():
                stats.fatal = str(err)
                stats.failure = Failure.HUNG if err.hung else Failure.DIED
                print(f"streamer: sample {sample_id}: {err}", flush=True)
            break
        except Exception as err:  # noqa: BLE001 - one bad sample must not stop the stream
            if stop.is_set():  # the stream is over and the verifier is shutting down
                break
            stats.failed += 1
            streak += 1
            print(f"streamer: sample {sample_id} skipped: {err}", flush=True)
            if streak >= MAX_CONSECUTIVE_FAILURES:
                stats.fatal = f"{streak} captures failed in a row, last: {err}"
                stats.failure = Failure.BAD_SAMPLES
                break
            if not _put(out, (epoch, sample_id, None), stop):  # reported, so the trainers' ledger can close the epoch
                break
            continue
        streak = 0
        if not _put(out, (epoch, sample_id, cap), stop):
            break
    for _, _, future in pending:  # the stream ended early: drop what has not started
        future.cancel()
    _put(out, None, stop)


def _put(out: queue.Queue, item, stop: threading.Event) -> bool:
    """Put unless the stream is over (a full queue nobody reads would block this thread forever)."""
    while not stop.is_set():
        try:
            out.put(item, timeout=0.5)
            return True
        except queue.Full:
            continue
    return False


def run_streamer(rows: Callable[[list[list[int]], int], Iterable[tuple[int, int, list[int], list[int]]]],
                 capture: CaptureFn | None, planes: Planes, dtype: torch.dtype, prefetch: int = 2,
                 heartbeat_s: float = 2.0, capture_concurrency: int = 1,
                 start_capture: Callable[[], CaptureFn] | None = None, in_flight: int = 2,
                 total_in_flight: int | None = None, groups: list[list[int]] | None = None,
                 names: list[str] | None = None) -> StreamerStats:
    """Stream every row not yet trained; `stats.fatal` says why when the verifier failed.

    `rows(ledger, epoch)` yields (epoch, id, token ids, loss mask) from `epoch` on, skipping the
    ledger's (epoch, id) pairs. `start_capture` (instead of `capture`) starts the verifier once
    the trainers are listening. Up to `in_flight` samples per trainer are on the wire at once,
    `total_in_flight` in all (what the streamer's GPU holds beside vLLM).

    `groups`: the trainer ranks of each draft trained from this one capture (the variants of a
    sweep that shares the verifier, `names` each); default one group, every trainer. Each group
    sends its own ledger and gets every sample its ledger lacks, on the trainer of that group with
    the most credit; a sample two groups need is captured once and staged once. A group that
    loses a trainer is dropped (`stats.dropped`); the stream fails only when every group is gone.
    """
    start = start_capture if start_capture is not None else (lambda: capture)
    trainers = planes.trainers
    groups = groups or [list(trainers)]
    names = names or [f"group {g}" for g in range(len(groups))]
    group_of = {t: g for g, ranks in enumerate(groups) for t in ranks}
    stats = StreamerStats(per_trainer={t: 0 for t in trainers})
    progress = [_Progress.receive(g[0], planes) for g in groups]
    ledger, first_epoch = _Progress.common(progress)
    stats.skipped = len(ledger)

    credits = {t: 0 for t in trainers}
    acked: set[int] = set()  # trainers that sent STOP: done training, or acknowledging ours
    lost: set[int] = set()  # the trainers of a dropped group: nothing more goes to them
    changed = threading.Condition()
    # A failure the stream cannot survive (the last group gone) is raised in the main thread at
    # its next wait: the heartbeat and credit threads only record it.
    fatal_err: list[BaseException] = []

    def is_open(t: int) -> bool:
        return t not in acked and t not in lost

    def drop(t: int, err: BaseException) -> None:
        """Trainer `t` is gone (killed, out of memory): its group leaves the stream, in one line."""
        with changed:
            g = group_of[t]
            if not is_open(t) or g in stats.dropped:
                return
            # gloo's line starts with its source file ("[.../pair.cc:553] Connection closed by peer")
            first = re.sub(r"^\[[^\]]*\]\s*", "", str(err).splitlines()[0])[:120] if str(err) else type(err).__name__
            stats.dropped[g] = f"trainer rank {t} is gone ({first})"
            lost.update(groups[g])
            live = len(groups) - len(stats.dropped)
            if len(groups) > 1:
                print(f"streamer: variant {names[g]} (trainer ranks {groups[g][0]}..{groups[g][-1]}) dropped from "
                      f"the stream: {stats.dropped[g]}; {live} of {len(groups)} variants go on", flush=True)
            if not live:
                fatal_err.append(err)
            changed.notify_all()

    sender = SampleSender(planes, dtype, in_flight, total_in_flight, on_lost=drop)
    stats.sender = sender

    def credit_loop(t: int) -> None:
        """Blocking receives from one trainer on the control plane: credits, then its STOP."""
        while True:
            try:
                h = recv_header(t, planes)
            except Exception as err:  # noqa: BLE001 - a closed socket is how gloo reports a dead peer
                drop(t, err)
                return
            with changed:
                if h.kind == Kind.CREDIT:
                    credits[t] += h.length
                elif h.kind == Kind.STOP:
                    acked.add(t)
                changed.notify_all()
            if h.kind == Kind.STOP:
                # Its goodbye now, not at the stream's end: a draft that stops early (its step
                # budget, or its own failure) must not wait for the others to finish theirs.
                sender.control(Header(Kind.STOP), t)
                return

    for t in trainers:
        threading.Thread(target=credit_loop, args=(t,), daemon=True).start()
    stop = threading.Event()
    # Heartbeats have a thread of their own: the main thread may wait for a trainer's window
    # (a sample landing) or for a slow capture, and the trainers' watchdogs must not care.
    beat = threading.Thread(target=_beat_loop, args=(sender, lambda: [t for t in trainers if is_open(t)], changed,
                                                     heartbeat_s, stop, drop), daemon=True, name="heartbeat")
    beat.start()

    ready: queue.Queue = queue.Queue(maxsize=prefetch)
    producer = threading.Thread(target=_producer, args=(rows(ledger, first_epoch), start, ready, stats, stop,
                                                        capture_concurrency), daemon=True)
    producer.start()
    try:
        while True:
            try:
                item = ready.get(timeout=heartbeat_s / 2)
            except queue.Empty:  # a slow capture (long prefill): the beat thread keeps the trainers calm
                _raise_first(fatal_err)
                continue
            _raise_first(fatal_err)
            if item is None:
                break
            epoch, sample_id, cap = item
            with changed:
                wanted = [g for g, done in zip(groups, progress, strict=True)
                          if not done.has(epoch, sample_id) and any(is_open(t) for t in g)]
            if not wanted:
                if any(is_open(t) for t in trainers):
                    continue  # every group still training has it already
                break  # every trainer finished its steps: nothing left to feed
            if cap is None:  # a failed capture: one trainer per group records it, its gather shares it
                for g in wanted:
                    with changed:
                        open_ = [t for t in g if is_open(t)]
                    if open_:
                        sender.control(Header(Kind.SKIPPED, sample_id, epoch=epoch), open_[0])
                continue
            t0 = time.monotonic()
            dsts = []
            for g in wanted:
                best = _take_credit(g, credits, is_open, stats.per_trainer, changed, heartbeat_s, fatal_err)
                if best is not None:
                    dsts.append(best)
            stats.wait_credit_s += time.monotonic() - t0
            if not dsts:  # the groups that needed it finished (or were dropped) while we waited
                if not any(is_open(t) for t in trainers):
                    break
                continue
            reached = sender.send_many(cap, epoch, dsts)
            T, n_aux, H = cap.aux_TnH.shape
            stats.bytes += sample_bytes(T, n_aux, H, dtype) * len(reached)
            stats.sent += bool(reached)
            for t in reached:
                stats.per_trainer[t] += 1
        sender.drain()
        _raise_first(fatal_err)
        if stats.fatal is not None:  # not the end of the data: the trainers must not finish
            for t in trainers:
                if is_open(t):
                    sender.control(Header(Kind.FAILED, length=int(stats.failure or Failure.DIED)), t)
            return stats
        for t in trainers:
            if t not in lost:
                sender.control(Header(Kind.STOP), t)
        with changed:  # late credits are harmless; wait until every live trainer has acknowledged
            while any(is_open(t) for t in trainers):
                changed.wait(timeout=heartbeat_s)
                _raise_first(fatal_err)
    finally:
        stop.set()
    return stats


@dataclass
class _Progress:
    """What one group of trainers has trained: its epoch and that epoch's (epoch, id) ledger."""
    epoch: int
    ledger: set[tuple[int, int]]

    @classmethod
    def receive(cls, first: int, planes: Planes) -> _Progress:
        header = recv_header(first, planes)
        return cls(header.epoch, {(e, i) for e, i in recv_ledger(header, first, planes)})

    def has(self, epoch: int, sample_id: int) -> bool:
        return epoch < self.epoch or (epoch, sample_id) in self.ledger

    @staticmethod
    def common(groups: list[_Progress]) -> tuple[list[list[int]], int]:
        """The rows every group has trained, from the earliest group's epoch: what nobody needs."""
        first = min(g.epoch for g in groups)
        pairs = set.union(*(g.ledger for g in groups))
        return [[e, i] for e, i in sorted(pairs) if all(g.has(e, i) for g in groups)], first


def _take_credit(group: list[int], credits: dict[int, int], is_open: Callable[[int], bool], sent: dict[int, int],
                 changed: threading.Condition, heartbeat_s: float, fatal_err: list[BaseException]) -> int | None:
    """The trainer of `group` with the most credit (the least loaded from here), once it has one;
    None when the whole group has finished its steps or was dropped."""
    with changed:
        while True:
            open_ = [t for t in group if is_open(t)]
            if not open_:
                return None
            best = max(open_, key=lambda t: (credits[t], -sent[t]))
            if credits[best] > 0:
                credits[best] -= 1
                return best
            changed.wait(timeout=heartbeat_s / 2)  # held back by full trainer buffers
            _raise_first(fatal_err)


def _beat_loop(sender: SampleSender, open_trainers: Callable[[], list[int]], changed: threading.Condition,
               heartbeat_s: float, stop: threading.Event, lost: Callable[[int, BaseException], None]) -> None:
    """A HEARTBEAT to each open trainer that heard no header from us for `heartbeat_s`; a send
    that fails (a dead trainer's closed socket) goes to `lost`, and the others still hear theirs."""
    while not stop.wait(heartbeat_s / 4):
        with changed:
            open_ = open_trainers()
        for t in open_:
            try:
                sender.beat_if_due(t, heartbeat_s)
            except Exception as err:  # noqa: BLE001 - the stream decides what a lost trainer means
                lost(t, err)


def _raise_first(failed: list[BaseException]) -> None:
    if failed:
        raise failed[0]
