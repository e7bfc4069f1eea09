"""The world's rendezvous: a TCPStore that only the job's ranks can use.

torch's TCPStore has no authentication: whoever reaches its port may read, write, delete and
list keys (`list_keys`), and so join a world, poison it, or stall it. Three layers close it:

1. Rank 0 listens on the master address only (given a port alone, torch listens on every
   interface of the node), and stops listening the moment its store holds a connection for
   every rank: the server's constructor waits for exactly `world_size` clients, and every later
   store operation (the groups' keys, NCCL's unique ids) travels over those connections. From
   then on a stranger's connect is refused.
2. Every key lives under a prefix derived from a per-job secret, which the launcher hands each
   rank (an owner-only job file under Slurm, a fresh token for a local run), never on a command
   line. A stranger who raced in before the world formed cannot write a key the world reads
   without first listing the prefix.
3. Once the groups exist, every rank proves it holds the secret itself: an HMAC over its rank,
   all-gathered on the control plane. The prefix is a hash of the secret, so a stranger who
   listed it still cannot prove membership, and every rank stops with one line.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import secrets
import socket

import torch
import torch.distributed as dist

_RETIRED: list[int] = []  # the write ends of the pipes that stand in for retired listeners (see _stop_listening)


def new_secret() -> str:
    return secrets.token_hex(32)


def key_prefix(secret: str) -> str:
    return "dspark-" + hashlib.sha256(b"dspark rendezvous prefix\0" + secret.encode()).hexdigest()[:32]


def _check_secret(secret: str) -> None:
    if not isinstance(secret, str) or len(secret) < 32:
        raise ValueError("the rendezvous secret must be a string of 32+ characters (rendezvous.new_secret())")


def rendezvous_store(rank: int, world_size: int, master_addr: str, port: int, timeout: datetime.timedelta,
                     secret: str) -> dist.Store:
    """The world's key-value store, under the job's prefix (layers 1 and 2 above)."""
    _check_secret(secret)
    if rank != 0:
        store = dist.TCPStore(master_addr, port, world_size, False, timeout)
    else:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((socket.gethostbyname(master_addr), port))
        sock.listen(1024)
        # Returns once every rank's client has connected (wait_for_workers): stop listening now.
        store = dist.TCPStore(master_addr, port, world_size, True, timeout, master_listen_fd=sock.fileno())
        _stop_listening(sock)
    return dist.PrefixStore(key_prefix(secret), store)


def _stop_listening(sock: socket.socket) -> None:
    """Close the listener under the store's server loop, which still polls its fd number.

    Shutting the socket down instead leaves it in the loop's epoll set reporting EPOLLHUP, and
    libuv answers each wake-up with an accept() that fails: the server thread spun a whole core
    for the rest of the run on every world's rank 0. Closing the number outright would let the
    next open() reuse it under libuv. So the number is handed to a pipe that never becomes
    readable: the listener's last reference goes, the kernel drops it from the epoll set, and a
    stranger's connect is refused.
    """
    fd = sock.detach()
    read_end, write_end = os.pipe()
    os.dup2(read_end, fd, inheritable=False)  # closes the listener; fd is now the pipe's read end
    os.close(read_end)
    _RETIRED.append(write_end)  # held open for good: the read end never sees EOF


def _proof(secret: str, rank: int) -> torch.Tensor:
    digest = hmac.new(secret.encode(), f"dspark rank {rank}".encode(), hashlib.sha256).digest()
    return torch.frombuffer(bytearray(digest), dtype=torch.uint8)


def check_members(secret: str, rank: int, world_size: int, group) -> None:
    """Layer 3 (collective over `group`, a gloo group of the whole world): every member holds the
    secret. Per-rank proofs, so a member cannot replay another's."""
    proofs = [torch.zeros(32, dtype=torch.uint8) for _ in range(world_size)]
    dist.all_gather(proofs, _proof(secret, rank), group=group)
    strangers = [r for r, p in enumerate(proofs) if not hmac.compare_digest(bytes(p.tolist()),
                                                                          bytes(_proof(secret, r).tolist()))]
    if strangers:
        raise RuntimeError(f"rank(s) {strangers} of this world do not hold the job's rendezvous secret: a process "
                           "that is not one of ours joined the rendezvous store; stopping (the job's files and "
                           "network are reachable by another user: check cluster.log_dir's permissions)")
