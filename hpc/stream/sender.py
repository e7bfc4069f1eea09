"""The streamer's data-plane sends: whole samples, up to `in_flight` per trainer, never blocking
the thread that decides what goes where.

A blocking send per sample left one sample in flight per streamer: the next one waited for the
previous one to land, and a send to one trainer held up every other trainer. Here each sample's
two data messages are posted with `isend`, and the streamer's main thread only waits when a
trainer already has `in_flight` samples on the wire (it then waits for the oldest). Sends to
different trainers run side by side: each pair is its own NCCL communicator (its own gloo pair
on CPU), all posted from this one thread, so the one-thread-per-pair rule still holds.

A sample that goes to several trainers at once (one per variant of a sweep that shares the
verifier, `send_many`) is staged once: one cast, one host-to-device copy, then one pair of
sends per trainer from the same buffers, which stay alive until the last of them is done.

States keep the capture's dtype up to the one cast to the stream dtype, in the staging copy.
On CUDA the staging is pinned host memory copied to the device on a side stream with
`non_blocking=True`; the sends are posted on that stream, so NCCL waits for the copy and the
host thread does not. A sample's pinned buffer is reused once its copy is done, its device
buffer once its send is done. On CPU (gloo) tensors are sent from where they are.

With `on_lost`, a trainer that a header or a sample cannot reach (its socket closed: killed, out
of memory) is handed to it and left out from then on, and the sends to every other trainer go
on: the streamer then drops that trainer's draft alone. Without it, the failure is raised.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hpc.dist.planes import Planes
from hpc.dist.rules import Message, message
from hpc.stream.protocol import DTYPE_CODES, Header, Kind, carve, sample_bytes, send_header
from hpc.stream.sample import Capture


@dataclass(eq=False)  # compared by identity: one sample may sit in several trainers' windows
class _InFlight:
    works: list  # (trainer, work) of each posted send
    keep: list[torch.Tensor]  # what the sends read from: alive until they are done
    pinned: torch.Tensor | None = None
    copied: torch.cuda.Event | None = None

    @property
    def host_bytes(self) -> int:
        """Host memory this sample holds while in flight: its staging buffer, or (gloo) its tensors."""
        if self.pinned is not None:
            return self.pinned.numel()
        return sum(t.numel() * t.element_size() for t in self.keep if t.device.type == "cpu")


@dataclass
class SampleSender:
    planes: Planes
    dtype: torch.dtype
    in_flight: int = 2
    total: int | None = None  # all trainers together: what the GPU holds (default: no bound beyond in_flight)
    window: dict[int, deque] = field(default_factory=dict)
    order: deque = field(default_factory=deque)  # samples staged, oldest first, over every window
    # Control sends to one trainer come from two threads (samples here, heartbeats from the
    # streamer's beat thread): each header goes out whole, under its trainer's lock.
    locks: dict[int, threading.Lock] = field(default_factory=dict)
    last_control: dict[int, float] = field(default_factory=dict)  # trainer -> monotonic time of our last header
    closed: set[int] = field(default_factory=set)  # trainers we sent STOP or FAILED
    free_pinned: list[torch.Tensor] = field(default_factory=list)
    peak_host_bytes: int = 0  # staging memory held at once: what `bench stream` reports
    on_lost: Callable[[int, BaseException], None] | None = None  # a trainer we cannot reach (default: raise)
    lost: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.in_flight = max(1, self.in_flight)
        for t in self.planes.trainers:
            self.window.setdefault(t, deque())
            self.locks.setdefault(t, threading.Lock())
            self.last_control.setdefault(t, time.monotonic())
        self.cuda = self.planes.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.planes.device) if self.cuda else None

    def control(self, h: Header, dst: int) -> bool:
        """Send one header; False when it did not go: `dst` is lost, or we said goodbye to it."""
        try:
            with self.locks[dst]:
                if dst in self.lost or dst in self.closed:  # after STOP or FAILED it reads nothing from us
                    return False
                send_header(h, dst, self.planes)
                self.last_control[dst] = time.monotonic()
                if h.kind in (Kind.STOP, Kind.FAILED):  # the trainer reads nothing from us after these
                    self.closed.add(dst)
            return True
        except Exception as err:  # noqa: BLE001 - gloo's closed socket: the trainer is gone
            self._lose(dst, err)
            return False

    def _lose(self, dst: int, err: BaseException) -> None:
        if self.on_lost is None:
            raise err
        self.lost.add(dst)
        self.on_lost(dst, err)

    def beat_if_due(self, dst: int, heartbeat_s: float) -> None:
        """A HEARTBEAT when `dst` heard no header from us for `heartbeat_s`, unless we said goodbye."""
        with self.locks[dst]:
            if dst in self.closed or dst in self.lost or time.monotonic() - self.last_control[dst] <= heartbeat_s:
                return
            send_header(Header(Kind.HEARTBEAT), dst, self.planes)
            self.last_control[dst] = time.monotonic()

    def send(self, cap: Capture, epoch: int, dst: int) -> int:
        """Post one sample to `dst`; returns its payload bytes. Blocks only for a full window."""
        T, n_aux, H = cap.aux_TnH.shape
        return sample_bytes(T, n_aux, H, self.dtype) * len(self.send_many(cap, epoch, [dst]))

    def send_many(self, cap: Capture, epoch: int, dsts: list[int]) -> list[int]:
        """Post one sample to each of `dsts`, staged once; returns the trainers it went to (not one
        that is lost, or that we said goodbye to meanwhile). Blocks only for a full window."""
        for dst in dsts:
            while len(self.window[dst]) >= self.in_flight:
                self._finish_oldest(dst)
        while self.total is not None and len(self.order) >= max(self.total, 1):
            self._finish_oldest(None)
        T, n_aux, H = cap.aux_TnH.shape
        flight = self._stage(cap, T, n_aux, H)
        stream = torch.cuda.stream(self.copy_stream) if self.copy_stream is not None else contextlib.nullcontext()
        reached = []
        for dst in dsts:
            if not self.control(Header(Kind.SAMPLE, cap.sample_id, T, n_aux, H, epoch, DTYPE_CODES[self.dtype]), dst):
                continue
            try:
                with stream, message(Message.SAMPLE):  # NCCL: the sends wait for the copy on this stream
                    flight.works += [(dst, dist.isend(t, dst=dst, group=self.planes.data)) for t in flight.keep]
            except Exception as err:  # noqa: BLE001 - as for a header: that trainer is gone
                self._lose(dst, err)
                continue
            self.window[dst].append(flight)
            reached.append(dst)
        self.order.append(flight)
        self.peak_host_bytes = max(self.peak_host_bytes, sum(f.host_bytes for f in self.order))
        return reached

    def drain(self) -> None:
        """Wait for every posted send (the stream's end, or before reporting a failure)."""
        while self.order:
            self._finish_oldest(None)

    def _finish_oldest(self, dst: int | None) -> None:
        """Wait for the oldest sample to `dst` (any trainer: None), on every pair it went out on.
        A pair's sends complete in order, so waiting for the oldest never waits on a send posted
        after it on that pair."""
        f = self.window[dst][0] if dst is not None else self.order[0]
        self.order.remove(f)
        for q in self.window.values():
            if f in q:  # waiting for it on another pair also waits for what that pair sent before it
                q.remove(f)
        self._finish(f)

    def _stage(self, cap: Capture, T: int, n_aux: int, H: int) -> _InFlight:
        states = cap.packed_states()
        if not self.cuda or states.device.type == "cuda":  # gloo sends host tensors where they lie
            ids = self.planes.place(torch.stack([cap.input_ids_T.long(), cap.loss_mask_T.long()]))
            return _InFlight([], [ids, self.planes.place(states.contiguous(), dtype=self.dtype)])
        nbytes = sample_bytes(T, n_aux, H, self.dtype)
        pinned = self._take_pinned(nbytes)
        ids_h, states_h = carve(pinned, [((2, T), torch.int64), ((T, n_aux + 1, H), self.dtype)])
        ids_h[0].copy_(cap.input_ids_T)
        ids_h[1].copy_(cap.loss_mask_T)
        states_h.copy_(states)  # the one cast, if the capture's dtype is not the stream's
        assert self.copy_stream is not None
        with torch.cuda.stream(self.copy_stream):
            flat = self.planes.empty(nbytes, dtype=torch.uint8)  # the sample, not the whole reused buffer
            flat.copy_(pinned[:nbytes], non_blocking=True)
            copied = self.copy_stream.record_event()
        ids, states_d = carve(flat, [((2, T), torch.int64), ((T, n_aux + 1, H), self.dtype)])
        return _InFlight([], [ids, states_d], pinned, copied)

    def _take_pinned(self, nbytes: int) -> torch.Tensor:
        fits = [i for i, b in enumerate(self.free_pinned) if b.numel() >= nbytes]
        if fits:
            return self.free_pinned.pop(min(fits, key=lambda i: self.free_pinned[i].numel()))
        # At most in_flight per trainer are out, plus this one: drop the spare ones that do not fit.
        self.free_pinned.clear()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def _finish(self, f: _InFlight) -> None:
        stream = torch.cuda.stream(self.copy_stream) if self.copy_stream is not None else contextlib.nullcontext()
        with stream:
            for dst, w in f.works:
                try:
                    w.wait()  # gloo: the send is done; NCCL: the copy stream now waits for it
                except Exception as err:  # noqa: BLE001 - gloo's closed socket: the trainer is gone
                    if dst not in self.lost:
                        self._lose(dst, err)
        if self.copy_stream is not None:
            self.copy_stream.synchronize()  # the send itself is done: its device buffer may go
        if f.pinned is not None:
            self.free_pinned.append(f.pinned)
