"""Wire format between streamers (verifier nodes) and trainers, on the two planes of `hpc.dist.planes`.

Every message starts with a fixed-size int64 header on the control plane (gloo, CPU), so a
receiver can post its receive before it knows what comes: NCCL has no receive-from-any-source,
so trainers keep one header receive posted per streamer. A SAMPLE header is followed by two
tensors on the data plane (the training backend, on the device): token ids + loss mask [2, T]
and the aux states with the last hidden as one more column, [T, n_aux + 1, H], in the stream
dtype. Credits, heartbeats, STOP, skip reports and the ledger are control messages only.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from enum import IntEnum

import torch
import torch.distributed as dist

from hpc.dist.planes import Planes
from hpc.dist.rules import Message, message, placed
from hpc.stream.sample import Capture

HEADER_LEN = 8
DTYPES = {0: torch.float32, 1: torch.bfloat16, 2: torch.float16}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}


class Kind(IntEnum):
    SAMPLE = 1
    HEARTBEAT = 2  # a live streamer with nothing to send: keeps the trainer's watchdog quiet
    STOP = 3  # this streamer has no more samples
    CREDIT = 4  # trainer -> streamer: n more samples may be sent to me
    LEDGER = 5  # trainer 0 -> streamer: n sample ids already trained this epoch follow
    FAILED = 6  # streamer -> trainer: my verifier is gone (`length` is a Failure); stop, do not finish
    # streamer -> trainer: (epoch, sample_id) could not be captured and is not coming. The ledger
    # counts it as done, so its epoch can close (and the ledger shrink), and a restart skips it.
    SKIPPED = 7


class Failure(IntEnum):
    """Why a streamer ended its stream early; its own log has the details."""

    DIED = 1  # the verifier process exited
    HUNG = 2  # it stopped answering within stream.peer_timeout_s
    NOT_STARTED = 3  # it never got healthy
    BAD_SAMPLES = 4  # every capture failed on a live server

    def describe(self) -> str:
        return {1: "its verifier died", 2: "its verifier stopped answering (hung)",
                3: "its verifier failed to start", 4: "every capture failed on its live verifier"}[int(self)]


@dataclass
class Header:
    kind: Kind
    sample_id: int = 0
    length: int = 0  # tokens T (SAMPLE), credits (CREDIT), ids (LEDGER)
    n_aux: int = 0
    hidden: int = 0
    epoch: int = 0
    dtype: int = 0

    def tensor(self) -> torch.Tensor:
        return torch.tensor([int(self.kind), self.sample_id, self.length, self.n_aux, self.hidden, self.epoch,
                             self.dtype, 0], dtype=torch.int64)

    @classmethod
    def parse(cls, t: torch.Tensor) -> Header:
        v = t.tolist()
        return cls(Kind(v[0]), v[1], v[2], v[3], v[4], v[5], v[6])


def send_header(h: Header, dst: int, planes: Planes) -> None:
    dist.send(h.tensor(), dst=dst, group=planes.control)


def recv_header(src: int, planes: Planes) -> Header:
    buf = torch.zeros(HEADER_LEN, dtype=torch.int64)
    dist.recv(buf, src=src, group=planes.control)
    return Header.parse(buf)


class PostedHeader:
    """A header receive posted ahead: the next header lands while a sample's body is received, so
    the streamer's next send (and its heartbeats) need not wait for the body to finish."""

    def __init__(self, src: int, planes: Planes):
        self.buf = torch.zeros(HEADER_LEN, dtype=torch.int64)
        work = dist.irecv(self.buf, src=src, group=planes.control)
        assert work is not None  # None only for a rank outside the group: every rank is in control
        self.work = work

    def get(self) -> Header:
        self.work.wait()
        return Header.parse(self.buf)


class BufferPool:
    """Receive buffers reused from sample to sample, handed back once the trainer has packed a sample.

    A fresh buffer per sample costs a page-faulting allocation on CPU (glibc maps every
    allocation over 32 MB anew) and churn in the CUDA caching allocator. One byte buffer holds a
    whole sample (ids, then states), so the pool's bound is a count of samples: free and taken
    buffers together stay within `limit` (what credits let a trainer hold, and the micro-batches
    a step holds while it packs), except while more are taken at once; a release then drops the
    smallest free ones. Bounding the free ones alone let mixed lengths keep about twice the
    buffers, each grown to the longest sample.
    On CUDA the receives run on the receive thread's own stream and the trainer reads on its
    default stream: a release records an event after the trainer's copy out of the buffer
    (pack), and the next receive into it waits for that event (a dropped buffer is marked used
    by the default stream, so the allocator waits too).
    """

    def __init__(self, device: torch.device, limit: int = 16):
        self.device, self.limit = device, max(1, limit)
        self.free: list[torch.Tensor] = []  # ascending by size
        self.done: dict[int, torch.cuda.Event] = {}  # id(flat) -> the trainer's last use of it
        self.lent: dict[int, torch.Tensor] = {}  # id(capture) -> its buffer
        self.out = 0  # taken and not yet released
        self.lock = threading.Lock()
        self.allocated = 0

    def held(self) -> int:
        """Buffers alive in the pool's keeping: free and taken."""
        with self.lock:
            return len(self.free) + self.out

    def _trim(self, keep: int) -> None:
        drop = max(0, len(self.free) + self.out - keep)  # the smallest go
        for flat in self.free[:drop]:
            self.done.pop(id(flat), None)
        del self.free[:drop]

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of at least `nbytes` for one sample's receive."""
        with self.lock:
            fits = [i for i, b in enumerate(self.free) if b.numel() >= nbytes]
            if fits:  # the smallest that fits (the list is sorted)
                flat = self.free.pop(fits[0])
                used = self.done.pop(id(flat), None)
                if used is not None:  # on the receiving thread's stream: after the trainer's pack
                    torch.cuda.current_stream(self.device).wait_event(used)
                self.out += 1
                return flat
            self._trim(self.limit - 1)  # none fits: a free one makes room for the larger buffer
        flat = placed(torch.empty(nbytes, dtype=torch.uint8, device=self.device))
        with self.lock:
            self.out += 1
            self.allocated += 1
        return flat

    def abandon(self, flat: torch.Tensor) -> None:
        """A taken buffer whose receive failed: it leaves the pool."""
        with self.lock:
            self.out -= 1

    def lend(self, cap: Capture, flat: torch.Tensor) -> Capture:
        with self.lock:
            self.lent[id(cap)] = flat
        return cap

    def release(self, cap: Capture) -> None:
        """The trainer is done with this capture's tensors: its buffer serves the next samples."""
        with self.lock:
            flat = self.lent.pop(id(cap), None)
            if flat is None:
                return
            self.out -= 1
            if self.device.type == "cuda":  # called on the trainer's thread, right after its pack
                stream = torch.cuda.current_stream(self.device)
                flat.record_stream(stream)
                self.done[id(flat)] = stream.record_event()
            self.free.append(flat)
            self.free.sort(key=lambda b: b.numel())
            self._trim(self.limit)


def carve(flat: torch.Tensor, parts: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """Consecutive views of `flat` (uint8) with these shapes and dtypes; each part's byte size
    must keep the next one aligned to its dtype (ids first: int64, 16 B a token)."""
    out, at = [], 0
    for shape, dtype in parts:
        n = math.prod(shape) * dtype.itemsize
        out.append(flat[at:at + n].view(dtype).view(shape))
        at += n
    return out


def sample_bytes(length: int, n_aux: int, hidden: int, dtype: torch.dtype) -> int:
    """One sample's receive buffer: ids + loss mask (int64) and the states."""
    return 2 * length * 8 + length * (n_aux + 1) * hidden * dtype.itemsize


def recv_sample_body(h: Header, src: int, planes: Planes, pool: BufferPool | None = None) -> Capture:
    states_dtype = DTYPES[h.dtype]
    nbytes = sample_bytes(h.length, h.n_aux, h.hidden, states_dtype)
    flat = planes.empty(nbytes, dtype=torch.uint8) if pool is None else pool.take(nbytes)
    ids, states = carve(flat, [((2, h.length), torch.int64), ((h.length, h.n_aux + 1, h.hidden), states_dtype)])
    try:
        with message(Message.SAMPLE):  # both posted at once: the second message need not wait for a round trip
            works = [dist.irecv(t, src=src, group=planes.data) for t in (ids, states)]
            for w in works:
                assert w is not None  # every rank is in the data plane
                w.wait()
    except BaseException:
        if pool is not None:
            pool.abandon(flat)
        raise
    cap = Capture.from_states(h.sample_id, ids[0], ids[1], states)
    return cap if pool is None else pool.lend(cap, flat)


def send_ledger(pairs: list[list[int]], epoch: int, dst: int, planes: Planes) -> None:
    """The trainer's ledger: (epoch, sample id) pairs already trained, from `epoch` on."""
    send_header(Header(Kind.LEDGER, length=len(pairs), epoch=epoch), dst, planes)
    if pairs:
        dist.send(torch.tensor(pairs, dtype=torch.int64).reshape(len(pairs), 2), dst=dst, group=planes.control)


def recv_ledger(h: Header, src: int, planes: Planes) -> list[list[int]]:
    if h.length == 0:
        return []
    t = torch.empty(h.length, 2, dtype=torch.int64)
    dist.recv(t, src=src, group=planes.control)
    return t.tolist()
