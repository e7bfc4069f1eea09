"""One rank of the sender tests (spawned, so importable): trainers 0 and 1, the streamer rank 2."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from hpc.dist.planes import init_planes
from hpc.dist.streams import RecvStream
from hpc.stream.protocol import Header, Kind, PostedHeader, recv_header, recv_sample_body
from hpc.stream.sample import Capture
from hpc.stream.sender import SampleSender
from hpc.stream.streamer import _beat_loop

A, B, STREAMER = 0, 1, 2


def _cap(i: int) -> Capture:
    g = torch.Generator().manual_seed(i)
    return Capture.from_states(i, torch.arange(16) + i, torch.ones(16, dtype=torch.long),
                               torch.randn(16, 3, 8, generator=g, dtype=torch.float32).to(torch.bfloat16))


class Headers:
    """A trainer's header receives, one always posted ahead as the receiver keeps it (none after STOP)."""

    def __init__(self, planes):
        self.planes, self.seen = planes, []
        self.posted: PostedHeader | None = PostedHeader(STREAMER, planes)

    def next(self, skip_beats: bool = True):
        while True:
            assert self.posted is not None
            h = self.posted.get()
            self.seen.append(h.kind.name)
            self.posted = PostedHeader(STREAMER, self.planes) if h.kind != Kind.STOP else None
            if h.kind != Kind.HEARTBEAT or not skip_beats:
                return h


def windows(rank: int, port: int, out: str) -> None:
    """Two samples to each trainer are posted before either trainer receives a body."""
    torch.set_num_threads(1)
    planes = init_planes(rank, 3, [A, B], "gloo", torch.device("cpu"), "127.0.0.1", port, "s" * 64, timeout_s=30)
    try:
        result: dict = {}
        if rank == STREAMER:
            sender = SampleSender(planes, torch.bfloat16, in_flight=2)
            dist.barrier(group=planes.control)  # 1: the trainers' header receives are posted
            for i, dst in enumerate((A, A, B, B)):
                sender.send(_cap(i), 0, dst)
            result = {"posted": len(sender.order), "windows": [len(sender.window[t]) for t in (A, B)],
                      "host": sender.peak_host_bytes}
            dist.barrier(group=planes.control)  # 2: only now does a trainer receive a body
            sender.drain()
            for t in (A, B):
                sender.control(Header(Kind.STOP), t)
        else:
            # Two header receives posted (the receiver keeps one posted while it takes a body; here
            # no body is taken until the streamer has posted everything).
            posted = [PostedHeader(STREAMER, planes) for _ in range(2)]
            dist.barrier(group=planes.control)
            dist.barrier(group=planes.control)
            got = []
            with RecvStream(planes.device) as side:
                for p in posted:
                    h = p.get()
                    cap = recv_sample_body(h, STREAMER, planes)
                    side.synchronize()
                    ok = torch.equal(cap.packed_states(), _cap(h.sample_id).packed_states())
                    got.append([h.sample_id, str(cap.aux_TnH.dtype), ok])
            assert recv_header(STREAMER, planes).kind == Kind.STOP
            result = {"got": got}
        dist.barrier(group=planes.control)
        Path(out, f"windows{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _raise(_t: int, err: BaseException) -> None:
    raise err


def beats(rank: int, port: int, out: str) -> None:
    """The main thread waits for trainer A to take a sample body; B hears heartbeats meanwhile."""
    torch.set_num_threads(1)
    planes = init_planes(rank, 3, [A, B], "gloo", torch.device("cpu"), "127.0.0.1", port, "b" * 64, timeout_s=30)
    try:
        result: dict = {}
        if rank == STREAMER:
            sender = SampleSender(planes, torch.bfloat16, in_flight=1)
            stop = threading.Event()
            beat = threading.Thread(target=_beat_loop, args=(sender, lambda: [A, B], threading.Condition(), 0.2, stop,
                                                                   _raise))
            beat.start()
            sender.send(_cap(0), 0, A)
            sender.send(_cap(1), 0, A)  # A's window is full: this waits until A takes sample 0's body
            sender.drain()
            stop.set()
            beat.join()
            for t in (A, B):
                sender.control(Header(Kind.STOP), t)
        else:
            headers = Headers(planes)
            if rank == A:
                h0 = headers.next()
            else:  # B: a heartbeat arrives while the streamer's main thread waits on A's window
                while headers.next(skip_beats=False).kind != Kind.HEARTBEAT:
                    pass
            dist.barrier(group=planes.train_control)  # A takes its body only after B heard a heartbeat
            if rank == A:
                with RecvStream(planes.device):
                    recv_sample_body(h0, STREAMER, planes)
                    recv_sample_body(headers.next(), STREAMER, planes)
            while headers.next().kind != Kind.STOP:
                pass
            result = {"seen": headers.seen}
        Path(out, f"beats{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def groups(rank: int, port: int, out: str, ledgers: dict, n: int, b_takes: int) -> None:
    """One streamer feeds two groups of one trainer each (two drafts from one capture): each group
    sends its own ledger; B stops after `b_takes` samples, as a variant whose steps are done."""
    from hpc.stream.receiver import StreamReceiver
    from hpc.stream.streamer import run_streamer

    torch.set_num_threads(1)
    planes = init_planes(rank, 3, [A, B], "gloo", torch.device("cpu"), "127.0.0.1", port, "g" * 64, timeout_s=60)
    try:
        result: dict = {}
        if rank == STREAMER:
            captured: list[int] = []

            def rows(ledger, epoch):
                done = {tuple(p) for p in ledger}
                result["common_ledger"] = sorted(done)
                return ((0, i, [], []) for i in range(n) if (0, i) not in done)

            def capture(i, ids, mask):
                captured.append(i)
                return _cap(i)

            stats = run_streamer(rows, capture, planes, torch.bfloat16, heartbeat_s=0.5, in_flight=2,
                                 groups=[[A], [B]])
            assert stats.sender is not None
            result.update(captured=captured, sent=stats.sent, bytes=stats.bytes, per_trainer=stats.per_trainer,
                          host=stats.sender.peak_host_bytes, fatal=stats.fatal)
        else:
            ledger = ledgers[str(rank)]
            recv = StreamReceiver([STREAMER], 4, planes, peer_timeout_s=30.0).start(ledger, 0, share_ledger=True)
            got = []
            while (item := recv.get()) is not None:
                src, _, cap = item
                ok = torch.equal(cap.packed_states(), _cap(cap.sample_id).packed_states())
                got.append([cap.sample_id, ok])
                recv.consumed(src)
                recv.release(cap)
                if rank == B and len(got) == b_takes:
                    break
            recv.close()
            result = {"got": got}
        Path(out, f"groups{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
