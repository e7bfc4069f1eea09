"""NCCL's order rule, checked across ranks where only gloo runs: what one rank posts on an NCCL
communicator, its peers must post in the same order, with the same shapes and dtypes.

Gloo matches p2p messages by bytes, so a streamer sending (states, ids) to a trainer that
receives (ids, states) of equal size, or an int32 buffer into a float32 one, passes on CPU.
NCCL matches ops in posting order by count and type: the same code hangs there, or reads
garbage. And NCCL's `batch_isend_irecv`, when it is the first op on a group, must be called by
every rank of that group.

In checked mode (`hpc.dist.rules`) every rank records, per data-plane group, each op it posts:
p2p with (direction, peer, shape, dtype), collectives with (name, shape, dtype). At shutdown
(`destroy_process_group`, or process exit) it writes them under `$DSPARK_NCCL_CHECK_LOG.order/`,
and `compare` (the test session runs it after every test) pairs the ranks of each world up.
Ranks that stopped early (a killed peer, an error path) are compared on what both recorded.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

ORDER_SUFFIX = ".order"


class OrderLog:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.world: str | None = None  # the same on every rank of one world: set by init_planes
        self.rank = -1
        self.groups: dict[str, list[int]] = {}  # group name -> its global ranks
        self.ops: dict[str, list[list]] = defaultdict(list)
        self.first: dict[str, str] = {}  # group name -> the kind of this rank's first op on it
        self.written = False

    def begin(self, world: str, rank: int) -> None:
        with self.lock:
            self.world, self.rank, self.written = world, rank, False
            self.groups.clear()
            self.ops.clear()
            self.first.clear()

    def _name(self, group) -> str | None:
        if self.world is None or group is None:
            return None
        try:
            name = str(group.group_name)
            if name not in self.groups:
                self.groups[name] = dist.get_process_group_ranks(group)
        except (RuntimeError, ValueError, AttributeError):  # not a real group (unit tests)
            return None
        return name

    def p2p(self, group, op: str, peer, tensor: torch.Tensor, batched: bool = False) -> None:
        with self.lock:
            name = self._name(group)
            if name is None or peer is None:
                return
            self.first.setdefault(name, "batch_isend_irecv" if batched else op)
            direction = "send" if op in ("send", "isend") else "recv"
            self.ops[name].append(["p2p", direction, int(peer), list(tensor.shape), str(tensor.dtype)])

    def collective(self, group, op: str, tensors: list[torch.Tensor]) -> None:
        with self.lock:
            name = self._name(group)
            if name is None:
                return
            self.first.setdefault(name, op)
            t = tensors[0] if tensors else None
            self.ops[name].append(["coll", op, list(t.shape) if t is not None else [], str(t.dtype) if t is not None
                                   else ""])

    def write(self, clean: bool) -> None:
        log = os.environ.get("DSPARK_NCCL_CHECK_LOG")
        with self.lock:
            if self.world is None or self.written or not log:
                return
            self.written = True
            where = Path(log + ORDER_SUFFIX) / self.world
            where.mkdir(parents=True, exist_ok=True)
            body = {"rank": self.rank, "clean": clean, "groups": self.groups, "ops": self.ops, "first": self.first}
            tmp = where / f".rank{self.rank}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(body))
            tmp.replace(where / f"rank{self.rank}.json")


LOG = OrderLog()
atexit.register(LOG.write, False)


def compare(root: Path) -> list[str]:
    """Every mismatch between the ranks' recorded op sequences under `root` (one directory per world)."""
    problems: list[str] = []
    if not root.is_dir():
        return problems
    for world in sorted(p for p in root.iterdir() if p.is_dir()):
        dumps = {}
        for f in world.glob("rank*.json"):
            d = json.loads(f.read_text())
            dumps[d["rank"]] = d
        problems += [f"world {world.name}: {p}" for p in _compare_world(dumps)]
    return problems


def _compare_world(dumps: dict[int, dict]) -> list[str]:
    out = []
    groups: dict[str, list[int]] = {}
    for d in dumps.values():
        groups.update(d["groups"])
    for name, members in groups.items():
        firsts = {r: dumps[r]["first"].get(name) for r in members if r in dumps}
        if "batch_isend_irecv" in firsts.values():
            left_out = [r for r, k in firsts.items() if k != "batch_isend_irecv"]
            if left_out:
                out.append(f"group {name}: its first op is batch_isend_irecv on some ranks, not on ranks {left_out}; "
                           "NCCL needs every rank of the group in a first batch_isend_irecv")
        colls = {r: [op for op in dumps[r]["ops"].get(name, []) if op[0] == "coll"] for r in members if r in dumps}
        out += _compare_collectives(name, colls, dumps)
        for src in members:
            for dst in members:
                if src != dst and src in dumps and dst in dumps:
                    out += _compare_pair(name, src, dst, dumps[src], dumps[dst])
    return out


def _compare_collectives(name: str, colls: dict[int, list], dumps: dict[int, dict]) -> list[str]:
    ranks = sorted(colls)
    for r in ranks[1:]:
        a, b = colls[ranks[0]], colls[r]
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return [f"group {name}: collective #{i} is {x[1:]} on rank {ranks[0]} but {y[1:]} on rank {r}"]
        if len(a) != len(b) and dumps[ranks[0]]["clean"] and dumps[r]["clean"]:
            return [f"group {name}: rank {ranks[0]} ran {len(a)} collectives, rank {r} ran {len(b)}"]
    return []


def _compare_pair(name: str, src: int, dst: int, a: dict, b: dict) -> list[str]:
    sends = [op[3:] for op in a["ops"].get(name, []) if op[0] == "p2p" and op[1] == "send" and op[2] == dst]
    recvs = [op[3:] for op in b["ops"].get(name, []) if op[0] == "p2p" and op[1] == "recv" and op[2] == src]
    for i, (s, r) in enumerate(zip(sends, recvs)):
        if s != r:
            return [f"group {name}: message #{i} from rank {src} to rank {dst} is sent as {s[1]} {s[0]} and "
                    f"received as {r[1]} {r[0]} (NCCL matches p2p ops in order, by count and type)"]
    if len(sends) != len(recvs) and a["clean"] and b["clean"]:
        return [f"group {name}: rank {src} sent {len(sends)} messages to rank {dst}, which received {len(recvs)}"]
    return []
