"""Trainer side of the stream: a receive thread per streamer, a control thread, and the micro-batch source.

Each receive thread keeps one header receive posted with its streamer on the control plane
(NCCL cannot receive from any source) and pulls sample bodies from that streamer on the data
plane: it is the only thread of this rank that touches the data plane with that peer. The
control thread owns every send (credits, STOP), all on the control plane.
A streamer silent for longer than `peer_timeout_s` (no sample, no heartbeat) is declared
dead: the source then stops the step loop on every trainer rank at the same step, so the
driver can checkpoint and exit naming the peer.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from hpc.dist.planes import Planes, bind_thread
from hpc.dist.streams import RecvStream, handoff
from hpc.stream.protocol import (
    BufferPool,
    Failure,
    Header,
    Kind,
    PostedHeader,
    recv_header,
    recv_sample_body,
    send_header,
    send_ledger,
)
from hpc.stream.sample import Capture, MicroBatch


class PeerDied(RuntimeError):
    pass


class StreamReceiver:
    """One blocking receive thread per streamer, and one control thread that owns every send.

    (Polling `irecv(...).is_completed()` does not work on gloo: it stays False until waited.)
    """

    def __init__(self, streamers: list[int], capacity: int, planes: Planes, peer_timeout_s: float = 30.0,
                 names: dict[int, str] | None = None, held_per_step: int = 0, pool: BufferPool | None = None):
        self.streamers = list(streamers)
        self.planes = planes
        self.timeout = peer_timeout_s
        self.names = names or {}
        # Each streamer may hold a share of this trainer's buffer; together they fill it, rounded up:
        # rounded down (8 over 3 streamers: 6) the shares could hold less than one micro-batch, and
        # credit returns only when a micro-batch is packed.
        self.share = max(1, -(-capacity // len(self.streamers)))
        self.samples: queue.Queue = queue.Queue()
        # Credits bound the samples received and not yet consumed to the shares; a step holds its
        # micro-batches (`held_per_step` samples, their credit already back) on top while it packs.
        # A smaller bound would drop and reallocate a step's buffers every step.
        # (`pool`: a warm one from an earlier receiver; `bench stream` compares against a raw send
        # into buffers it allocated once.)
        self.pool = pool or BufferPool(planes.device, limit=self.share * len(self.streamers) + held_per_step)
        self._events: queue.Queue = queue.Queue()  # ("credit" | "stop" | "error", streamer, msg)
        self._last_seen = {s: time.monotonic() for s in self.streamers}
        self._said_stop: set[int] = set()  # streamers that ended their stream: silence is expected
        self._mid_sample: dict[int, int] = {}  # streamer -> the sample whose body is being received
        self._skipped: list[tuple[int, int]] = []  # (epoch, id) of captures a streamer reported failed
        self._skip_lock = threading.Lock()
        self.error: str | None = None
        self.wait_s = 0.0
        self._done = threading.Event()

    def start(self, ledger: list[list[int]], epoch: int, share_ledger: bool) -> StreamReceiver:
        if share_ledger:
            for s in self.streamers:
                send_ledger(ledger, epoch, s, self.planes)
        for s in self.streamers:
            send_header(Header(Kind.CREDIT, length=self.share), s, self.planes)
        for s in self.streamers:
            threading.Thread(target=self._recv_loop, args=(s,), daemon=True).start()
        threading.Thread(target=self._control_loop, daemon=True).start()
        return self

    def consumed(self, source_rank: int) -> None:
        self._events.put(("credit", source_rank, ""))

    def release(self, cap) -> None:
        """The trainer packed this sample: its receive buffers may take the next one."""
        self.pool.release(cap)

    def close(self, timeout_s: float = 60.0) -> bool:
        """Training is over: tell every streamer to stop sending here, wait for their goodbyes.

        A streamer silent for `peer_timeout_s` is dead, whatever the control thread is doing: it
        may itself be stuck in a send to that peer, so the wait watches the clock too.
        """
        self._events.put(("close", -1, ""))
        deadline = time.monotonic() + timeout_s
        while not self._done.wait(0.2) and time.monotonic() < deadline:
            silent = self._silent(set(self.streamers) - self._said_stop)
            if silent:
                self.error = self.error or self._silence(silent[0])
                return False
        return self._done.is_set()

    def _name(self, rank: int) -> str:
        return self.names.get(rank, f"streamer rank {rank}")

    def _silent(self, among: set[int]) -> list[int]:
        """Streamers of `among` heard from neither sample nor heartbeat for `peer_timeout_s`."""
        now = time.monotonic()
        return sorted(s for s in among if now - self._last_seen[s] > self.timeout)

    def _silence(self, rank: int) -> str:
        return f"{self._name(rank)} sent nothing for {self.timeout:.0f} s (no sample, no heartbeat): it died or hangs"

    def _recv_loop(self, s: int) -> None:
        try:
            bind_thread(self.planes.device)
            # On CUDA the receives get a stream of their own, and this thread waits for each sample
            # to land before the trainer sees it. On the default stream a receive would queue behind
            # the trainer's compute, DDP's all-reduce wait included: a trainer ahead of the others
            # then holds its streamer's send, and with it the sample a trainer behind is waiting for
            # (a cross-rank deadlock). And a streamer dying mid-sample stalls only this thread, so
            # the silence watchdog still stops training cleanly.
            with RecvStream(self.planes.device) as side:  # on CPU a stand-in the checker follows
                self._recv_from(s, side)
        except Exception as err:  # noqa: BLE001 - a closed socket is how gloo reports a dead peer
            first = str(err).splitlines()[0][:160] if str(err) else type(err).__name__
            if s in self._mid_sample:  # the header came, the data did not: the data plane's timeout fired
                first = (f"sample {self._mid_sample[s]} stopped mid-send: its header arrived, its data did not "
                         f"within the data plane's timeout (stream.nccl_timeout_s) ({first})")
            self._events.put(("error", s, f"{self._name(s)} failed: {first}"))

    def _recv_from(self, s: int, side: RecvStream) -> None:
        posted = None
        while True:
            h = posted.get() if posted is not None else recv_header(s, self.planes)
            posted = None
            self._last_seen[s] = time.monotonic()
            if h.kind == Kind.SAMPLE:
                self._mid_sample[s] = h.sample_id
                posted = PostedHeader(s, self.planes)  # a SAMPLE is always followed by another header
                cap = recv_sample_body(h, s, self.planes, self.pool)
                del self._mid_sample[s]
                side.synchronize()
                handoff([cap.input_ids_T, cap.aux_TnH], f"sample {h.sample_id} from {self._name(s)}")
                self.samples.put((s, h.epoch, cap))
                self._last_seen[s] = time.monotonic()
            elif h.kind == Kind.SKIPPED:
                with self._skip_lock:
                    self._skipped.append((h.epoch, h.sample_id))
            elif h.kind == Kind.STOP:
                self._said_stop.add(s)
                self._events.put(("stop", s, ""))
                return
            elif h.kind == Kind.FAILED:
                why = Failure(h.length).describe() if h.length in {f.value for f in Failure} else "it failed"
                self._events.put(("error", s, f"{self._name(s)}: {why}; see that node's log"))
                return

    def _control_loop(self) -> None:
        live = set(self.streamers)
        told: set[int] = set()  # streamers we sent STOP to: their STOP back is the goodbye
        # Credits go back in batches of half a share: one message per sample in the reverse
        # direction costs the stream measurable throughput. No deadlock: a streamer with no
        # credit left means a whole share is consumed or in flight, and the tick flushes the rest.
        owed = {s: 0 for s in self.streamers}
        batch = max(1, self.share // 2)
        try:
            while live:
                try:
                    kind, s, msg = self._events.get(timeout=0.2)
                except queue.Empty:
                    kind, s, msg = "tick", -1, ""
                if kind == "credit" and s in live and s not in told:
                    owed[s] += 1
                elif kind == "stop":
                    if s not in told:  # the streamer ran out of data: acknowledge, no more credits
                        send_header(Header(Kind.STOP), s, self.planes)
                    live.discard(s)
                elif kind == "close":
                    for d in live - told:
                        send_header(Header(Kind.STOP), d, self.planes)
                    told |= live
                elif kind == "error":
                    raise PeerDied(msg)
                for d in live - told:
                    if owed[d] >= batch or (kind == "tick" and owed[d]):
                        send_header(Header(Kind.CREDIT, length=owed[d]), d, self.planes)
                        owed[d] = 0
                dead = self._silent(live)
                if dead:
                    raise PeerDied(self._silence(dead[0]))
        except Exception as err:  # noqa: BLE001 - reported to the training thread, which decides
            self.error = str(err)
        self.samples.put(None)
        self._done.set()

    def take_skipped(self) -> list[tuple[int, int]]:
        with self._skip_lock:
            taken, self._skipped = self._skipped, []
        return taken

    def get(self):
        t0 = time.monotonic()
        item = self.samples.get()
        self.wait_s += time.monotonic() - t0
        if item is None:
            self.samples.put(None)  # every later get also sees the end
        return item


def stream_micro_batches(receiver: StreamReceiver, micro_batch_size: int) -> Iterator[MicroBatch]:
    """Full micro-batches while every trainer rank has one; all ranks stop at the same step.

    The agreement and the ledger gather are bookkeeping: CPU tensors on the trainers' gloo group.
    """
    group = receiver.planes.train_control
    while True:
        mine: list[tuple[int, int, Capture]] = []  # (source rank, epoch, capture)
        while len(mine) < micro_batch_size:
            item = receiver.get()
            if item is None:
                break
            mine.append(item)
        skips = receiver.take_skipped()
        world = dist.get_world_size(group)
        # One gather says both whether every rank has a full micro-batch and how many skip reports
        # each holds, so the pairs' gather below has one shape on every rank.
        counts = [torch.empty(2, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(counts, torch.tensor([int(len(mine) == micro_batch_size), len(skips)]), group=group)
        if not all(int(c[0]) for c in counts):
            return
        width = max(int(c[1]) for c in counts)
        pad = [(-1, -1)] * (width - len(skips))
        pairs = torch.tensor([(epoch, cap.sample_id) for _, epoch, cap in mine] + skips + pad,
                             dtype=torch.int64).reshape(-1, 2)
        gathered = [torch.empty_like(pairs) for _ in range(world)]
        dist.all_gather(gathered, pairs, group=group)
        for src, _, _ in mine:
            receiver.consumed(src)
        caps = [cap for _, _, cap in mine]

        def release(caps: list[Capture] = caps) -> None:
            for c in caps:
                receiver.release(c)

        consumed = [tuple(p) for g in gathered for p in g[:micro_batch_size].tolist()]
        skipped = [tuple(p) for g in gathered for p in g[micro_batch_size:].tolist() if p[0] >= 0]
        yield MicroBatch(caps, consumed, release=release, skipped=skipped,
                         origins=[receiver._name(src) for src, _, _ in mine])
