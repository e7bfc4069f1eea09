"""NCCL's rules, enforced where only gloo runs (CPU tests), so a GPU run cannot be the first to hit them.

Gloo accepts patterns that NCCL refuses or deadlocks on. In checked mode (`DSPARK_NCCL_CHECK=1`,
on in every test and inherited by every process a test starts) the torch.distributed calls
our code makes are wrapped, and a call that breaks a rule raises `NCCLRuleError` before it
runs. Each violation is also appended to `$DSPARK_NCCL_CHECK_LOG`, which the test session
reads after every test: a rank process that swallows the exception still fails its test.

The rules (groups are registered with a plane and the device type their backend takes):
1. a p2p op to a peer on the data plane from a thread other than the one that owns that pair
   (NCCL runs one pair's sends and receives on one stream, and its calls return once queued:
   a second thread's op waits behind a pending receive, or lands in a random order). A thread
   owns a pair from its first op until it calls `handover`;
2. a control message on the data plane, or sample tensors on the control plane;
3. a p2p op or collective on a group with tensors of another device type (an NCCL group refuses
   CPU tensors: "No backend type associated with device type cpu"). The data plane is NCCL's on
   a cluster, so `init_planes` registers it as taking CUDA tensors on every backend: under gloo
   a CPU tensor passes only if our code placed it on the data device (`placed`, which
   `Planes.place` calls), the bookkeeping of a CUDA run done on host memory;
4. a receive from any source (NCCL has none);
5. data-plane p2p in both directions between one pair (the stream's data flows one way);
6. an object collective (`broadcast_object_list`, `all_gather_object`, ...): not an NCCL rule
   but a trust one. They unpickle what a peer sent, so a peer could run code in every rank;
   our ranks exchange tensors (text as bytes: `hpc.dist.planes.broadcast_text`).

7. across ranks (`hpc.dist.order`): each data-plane group's ops in one order with one shape and
   dtype on both ends, and a first `batch_isend_irecv` on a group called by all its ranks.
   Each rank records its ops; the test session compares the ranks after every test;
8. streams (`hpc.dist.streams`): a data-plane receive outside a `RecvStream` (on CUDA: on the
   default stream, behind the trainer's compute), and a received buffer handed on before its
   stream was synchronised.

Calls on unregistered groups are checked for rules 4 and 6 only.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import os
import threading
import weakref
from collections.abc import Iterator
from enum import Enum

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from hpc.dist import order
import hashlib

ENV = "DSPARK_NCCL_CHECK"
NCCL_DEVICE = "cuda"  # what the data plane takes on a cluster, registered on every backend
LOG_ENV = "DSPARK_NCCL_CHECK_LOG"
CHECKED = "_dspark_checked"  # set on each wrapper: `rules.installed()` and tests read it


class Plane(str, Enum):
    CONTROL = "control"  # gloo, CPU tensors: headers, credits, heartbeats, STOP, ledger, bookkeeping
    DATA = "data"  # the training backend (NCCL on GPU): sample tensors, DDP gradients


class Message(str, Enum):
    CONTROL = "control"
    SAMPLE = "sample"


class NCCLRuleError(RuntimeError):
    """Code that works on gloo but fails or deadlocks under NCCL."""


_P2P = ("send", "recv", "isend", "irecv")
_OBJECT_COLLECTIVES = ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
                       "send_object_list", "recv_object_list")
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce", "reduce_scatter",
                "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "barrier")


class Checker:
    """The rules' state: registered groups, the owner thread of each data-plane pair, directions used."""

    def __init__(self) -> None:
        self.groups: dict = {}  # process group -> (plane, device type)
        self.local = threading.local()
        self.lock = threading.Lock()
        self.owners: dict = {}  # (group, peer) -> the token of the thread that owns the pair on the data plane
        self._tokens = itertools.count(1)
        self.directions: dict = {}  # (group, peer) -> {"send", "recv"}
        self.violations: list[str] = []
        # hpc.dist.streams: storages received on a RecvStream and not yet synchronised, per stream
        self.pending: dict[int, set[int]] = {}
        # Storages our code placed on the data device: on CPU, what would live on the GPU. Storages
        # keep their Python object while any view lives, so the set forgets exactly the freed ones
        # (a reused address is not taken for a placed tensor).
        self.placed: weakref.WeakSet = weakref.WeakSet()

    def register(self, group, plane: Plane, device_type: str) -> None:
        if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
            return
        self.groups[group] = (Plane(plane), device_type)

    def place(self, t: torch.Tensor) -> None:
        with self.lock:
            self.placed.add(t.untyped_storage())

    def device_type(self, t: torch.Tensor) -> str:
        """The tensor's device as a CUDA run would see it: a placed host tensor stands for a GPU one."""
        if t.device.type == "cpu":
            with self.lock:
                if t.untyped_storage() in self.placed:
                    return NCCL_DEVICE
        return t.device.type

    def kind(self) -> Message:
        return getattr(self.local, "kind", Message.CONTROL)

    def thread_token(self) -> int:
        """This thread's identity for pair ownership: never reused, unlike threading.get_ident(),
        which a new thread may inherit from one that exited still owning a pair."""
        token = getattr(self.local, "token", None)
        if token is None:
            token = self.local.token = next(self._tokens)
        return token

    @contextlib.contextmanager
    def message(self, kind: Message) -> Iterator[None]:
        """Declare what the enclosed calls carry; undeclared calls are control (bookkeeping)."""
        previous = self.kind()
        self.local.kind = kind
        try:
            yield
        finally:
            self.local.kind = previous

    def violate(self, *rules: str) -> None:
        """Log every broken rule of one call, then raise once."""
        msgs = [f"NCCL rule broken: {r}" for r in rules]
        self.violations.extend(msgs)
        path = os.environ.get(LOG_ENV)
        if path:
            with open(path, "a") as fh:
                for m in msgs:
                    fh.write(f"[pid {os.getpid()} thread {threading.current_thread().name}] {m}\n")
        raise NCCLRuleError("; ".join(msgs))

    # -- the checks, called before the real op ---------------------------------------------
    def _plane_rules(self, group, what: str, tensors: list[torch.Tensor]) -> list[str]:
        reg = self.groups.get(group)
        if reg is None:
            return []
        plane, device_type = reg
        kind = self.kind()
        broken = []
        if plane == Plane.DATA and kind == Message.CONTROL:
            broken.append(f"{what}: a control message or bookkeeping op on the data plane (NCCL); "
                          "send it as a CPU tensor on the gloo control group")
        if plane == Plane.CONTROL and kind == Message.SAMPLE:
            broken.append(f"{what}: sample tensors on the control plane (gloo); they belong on the data plane")
        for t in tensors:
            seen = self.device_type(t) if device_type == NCCL_DEVICE else t.device.type
            if seen != device_type:
                broken.append(f"{what}: a {t.device.type} tensor on a {plane.value}-plane group that takes "
                              f"{device_type} tensors (NCCL: 'No backend type associated with device type "
                              f"{t.device.type}'); create it on the data device (Planes.place)")
                break
        return broken

    def before_p2p(self, op: str, tensor: torch.Tensor, group, peer, batched: bool = False) -> None:
        broken = []
        if op in ("recv", "irecv") and peer is None:
            broken.append(f"{op} from any source: NCCL has no receive-from-any; post one receive per peer")
        broken += self._plane_rules(group, f"{op} with peer {peer}", [tensor])
        reg = self.groups.get(group)
        if reg is not None and reg[0] == Plane.DATA and peer is not None:
            key, me = (group, peer), self.thread_token()
            direction = "send" if op in ("send", "isend") else "recv"
            with self.lock:
                owner = self.owners.setdefault(key, me)
                if owner != me:
                    broken.append(f"{op} with peer {peer} on the data plane from a second thread: another thread "
                                  "owns this pair (NCCL serialises a pair on one stream: a deadlock or a random "
                                  "order); one thread per pair, or hand it over")
                used = self.directions.setdefault(key, set())
                if used and direction not in used and not _is_self(group, peer):  # a self-pair carries no stream
                    broken.append(f"{op} with peer {peer}: the data plane already carries the other direction "
                                  "with this peer; sample tensors flow streamer -> trainer only")
                used.add(direction)
            if direction == "recv":
                broken += self._stream_rules(op, tensor, peer)
        if broken:
            self.violate(*broken)
        if reg is not None and reg[0] == Plane.DATA:
            order.LOG.p2p(group, op, peer, tensor, batched)

    # -- streams (hpc.dist.streams) -------------------------------------------------------
    def enter_stream(self, stream) -> None:
        self.local.stream = stream

    def leave_stream(self) -> None:
        self.local.stream = None

    def stream_synced(self, stream) -> None:
        with self.lock:
            self.pending.pop(id(stream), None)

    def handoff(self, tensors: list[torch.Tensor], what: str) -> None:
        ptrs = {t.untyped_storage().data_ptr() for t in tensors}
        with self.lock:
            late = any(ptrs & p for p in self.pending.values())
        if late:
            self.violate(f"{what}: a buffer received on a side stream is handed on before that stream was "
                         "synchronised (CUDA: the trainer would read it before the receive lands); call "
                         "RecvStream.synchronize() first")

    def _stream_rules(self, op: str, tensor: torch.Tensor, peer) -> list[str]:
        stream = getattr(self.local, "stream", None)
        if stream is None:
            return [f"{op} with peer {peer} on the data plane outside a RecvStream: on CUDA it runs on the "
                    "default stream, behind the trainer's compute and DDP's all-reduce wait (a cross-rank "
                    "deadlock); receive inside hpc.dist.streams.RecvStream"]
        with self.lock:
            self.pending.setdefault(id(stream), set()).add(tensor.untyped_storage().data_ptr())
        return []

    def handover(self, group, peer) -> None:
        """The owning thread is done with this pair (after its ops are complete): the next user owns it."""
        with self.lock:
            self.owners.pop((group, peer), None)

    def owned(self, group, peer) -> bool:
        with self.lock:
            return (group, peer) in self.owners

    def before_collective(self, name: str, tensors: list[torch.Tensor], group) -> None:
        broken = self._plane_rules(group, name, tensors)
        if broken:
            self.violate(*broken)
        reg = self.groups.get(group)
        if reg is not None and reg[0] == Plane.DATA:
            order.LOG.collective(group, name, tensors)


CHECKER = Checker()
_originals: dict[str, object] = {}


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


def _is_self(group, peer) -> bool:
    try:
        return peer == dist.get_rank(group)
    except (RuntimeError, ValueError, TypeError, AttributeError):  # not a real group (unit tests)
        return False


def _group_of(bound: inspect.BoundArguments):
    group = bound.arguments.get("group")
    if group is None and dist.is_initialized():
        return dist.distributed_c10d._get_default_group()
    return group


def _peer(bound: inspect.BoundArguments, op: str):
    a = bound.arguments
    if op in ("send", "isend"):
        return a.get("dst") if a.get("dst") is not None else a.get("group_dst")
    return a.get("src") if a.get("src") is not None else a.get("group_src")


def _wrap_p2p(op: str):
    orig = getattr(dist, op)
    sig = inspect.signature(orig)

    @functools.wraps(orig)  # its name: P2POp(dist.isend, ...) reads op.__name__
    def checked(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        CHECKER.before_p2p(op, bound.arguments["tensor"], _group_of(bound), _peer(bound, op))
        return orig(*args, **kwargs)
    return checked


def _wrap_batch():
    orig = dist.batch_isend_irecv

    @functools.wraps(orig)
    def checked(p2p_op_list, *args, **kwargs):
        default = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
        for p in p2p_op_list:
            CHECKER.before_p2p(p.op.__name__, p.tensor, p.group or default, p.peer, batched=True)
        return orig(p2p_op_list, *args, **kwargs)
    return checked


def _tensors(bound: inspect.BoundArguments) -> list[torch.Tensor]:
    out = []
    for value in bound.arguments.values():
        if torch.is_tensor(value):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out.extend(v for v in value if torch.is_tensor(v))
    return out


def _wrap_collective(name: str):
    orig = getattr(dist, name)
    sig = inspect.signature(orig)

    @functools.wraps(orig)
    def checked(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        CHECKER.before_collective(name, _tensors(bound), _group_of(bound))
        return orig(*args, **kwargs)
    return checked


def _wrap_destroy():
    orig = dist.destroy_process_group

    @functools.wraps(orig)
    def destroy(*args, **kwargs):
        if not args and not kwargs.get("group"):  # the whole world: this rank's op order is final
            order.LOG.write(clean=True)
        return orig(*args, **kwargs)
    return destroy


def _wrap_object_collective(name: str):
    @functools.wraps(getattr(dist, name))
    def refused(*args, **kwargs):
        CHECKER.violate(f"rule 6: dist.{name} unpickles what a peer sent; exchange tensors "
                        "(hpc.dist.planes.broadcast_text for text)")
    return refused


def install() -> None:
    """Wrap torch.distributed's p2p and collective calls (idempotent), in both namespaces: code
    that calls `distributed_c10d.isend` directly is checked too, and P2POp, which accepts only
    the c10d module's own isend/irecv, accepts the wrapped ones."""
    if _originals:
        return
    wrapped: dict[str, object] = {}
    for name in _P2P:
        wrapped[name] = _wrap_p2p(name)
    for name in _COLLECTIVES:
        if hasattr(dist, name):
            wrapped[name] = _wrap_collective(name)
    for name in _OBJECT_COLLECTIVES:
        if hasattr(dist, name):
            wrapped[name] = _wrap_object_collective(name)
    wrapped["batch_isend_irecv"] = _wrap_batch()
    wrapped["destroy_process_group"] = _wrap_destroy()
    for name, fn in wrapped.items():
        _originals[name] = getattr(dist, name)
        fn.__dict__[CHECKED] = True
        setattr(dist, name, fn)
        if getattr(c10d, name, None) is _originals[name]:
            setattr(c10d, name, fn)


def installed() -> bool:
    return getattr(dist.send, CHECKED, False)


def begin_world(port: int, secret: str, rank: int) -> None:
    """Name this world for the cross-rank order check (hpc.dist.order): the same on every rank."""
    order.LOG.begin(hashlib.sha256(f"{port}:{secret}".encode()).hexdigest()[:16], rank)


def install_from_env() -> bool:
    if enabled():
        install()
    return enabled()


def register(group, plane: Plane, device_type: str) -> None:
    CHECKER.register(group, plane, device_type)


def message(kind: Message):
    return CHECKER.message(kind)


def placed(t: torch.Tensor) -> torch.Tensor:
    """`t` is on the data device (call it where a CUDA run would have moved it there); returns `t`."""
    if installed():
        CHECKER.place(t)
    return t


def handover(group, peer) -> None:
    CHECKER.handover(group, peer)
