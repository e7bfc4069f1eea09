"""The world's rendezvous store: it listens on the master address only, and only until every
rank has connected; its keys live under the job secret's prefix; a member without the secret
stops the world; and no rank unpickles what a peer sent."""

from __future__ import annotations

import datetime
import json
import os
import socket
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hpc.dist.rendezvous import check_members, key_prefix, new_secret, rendezvous_store
from hpc.net import free_port
from tests.fixtures.sockets import listening_addresses

TIMEOUT = datetime.timedelta(seconds=20)


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def _store_thread_cpu() -> float:
    """CPU seconds of this process's TCPStore server thread(s) (torch names them pt_tcpstore*)."""
    total = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            if task.joinpath("comm").read_text().startswith("pt_tcpstore"):
                fields = task.joinpath("stat").read_text().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])  # utime, stime
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
    assert total or any(t.joinpath("comm").read_text().startswith("pt_tcpstore")
                        for t in Path("/proc/self/task").iterdir()), "no TCPStore server thread found"
    return total / os.sysconf("SC_CLK_TCK")


def test_the_store_listens_on_the_master_address_until_every_rank_joined_then_refuses_strangers():
    port, secret = free_port(), new_secret()
    got: dict = {}
    master = threading.Thread(target=lambda: got.update(store=rendezvous_store(0, 2, "127.0.0.1", port, TIMEOUT,
                                                                               secret)))
    master.start()
    try:
        # While the world forms: loopback only (torch's store, given a port alone, listens on "*").
        for _ in range(200):
            if listening_addresses(port):
                break
            threading.Event().wait(0.05)
        assert listening_addresses(port) == {"127.0.0.1"}
        # A plain connect does not count as a rank: the master still waits for rank 1.
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        assert master.is_alive()
        rank1 = rendezvous_store(1, 2, "127.0.0.1", port, TIMEOUT, secret)
    finally:
        master.join(30)
    assert not master.is_alive()
    # The world formed: nobody else gets in, and the ranks' own connections still work.
    assert listening_addresses(port) == set()
    assert _refused(port)
    # ... and its server thread sleeps until a rank asks: a retired listener must not wake it.
    spent = _store_thread_cpu()
    threading.Event().wait(1.0)
    assert _store_thread_cpu() - spent < 0.2, "the store's server thread spins on its retired listener"
    rank1.set("k", "v")
    assert got["store"].get("k") == b"v"
    # Every key sits under the secret's prefix: a key the world reads cannot be written by name.
    raw = rank1.underlying_store
    assert raw.check([f"{key_prefix(secret)}/k"]) and not raw.check(["k"])
    assert key_prefix(secret) != key_prefix(new_secret()) and secret not in key_prefix(secret)


def test_a_short_or_missing_secret_is_refused_before_any_socket():
    port = free_port()
    for bad in ("", "short", None):
        with pytest.raises(ValueError, match="rendezvous secret"):
            rendezvous_store(0, 1, "127.0.0.1", port, TIMEOUT, bad)  # type: ignore[arg-type]
    assert listening_addresses(port) == set()


def _member(rank: int, port: int, secrets: list[str], replay: bool, out: str) -> None:
    """A 2-rank world on a shared store; rank r then proves membership with secrets[r] (with
    `replay`, rank 1 sends rank 0's proof instead of its own)."""
    import hpc.dist.rendezvous as rv

    torch.set_num_threads(1)
    if replay and rank == 1:
        own = rv._proof
        rv._proof = lambda s, r: own(s, 0) if r == 1 else own(s, r)  # type: ignore[assignment]
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=TIMEOUT)
    try:
        check_members(secrets[rank], rank, 2, None)
        result = "ok"
    except RuntimeError as err:
        result = str(err)
    finally:
        dist.destroy_process_group()
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)


@pytest.mark.parametrize("who", ["one secret", "stranger", "replay"])
def test_a_member_without_the_secret_stops_the_world_in_one_line(tmp_path, who):
    """A stranger who raced into the world before it formed (it can list the prefix with
    `list_keys`) never learns the secret, and cannot replay a member's proof: per-rank HMACs."""
    secret = new_secret()
    secrets = [secret, new_secret()] if who == "stranger" else [secret, secret]
    mp.start_processes(_member, args=(free_port(), secrets, who == "replay", str(tmp_path)), nprocs=2,
                       start_method="spawn")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    if who == "one secret":
        assert (r0, r1) == ("ok", "ok")
        return
    assert "rank(s) [1] of this world do not hold the job's rendezvous secret" in r0, r0
    if who == "stranger":  # to the stranger, rank 0 is the odd one out: it stops too
        assert "rank(s) [0]" in r1, r1


@pytest.mark.nccl_violations_expected
def test_no_rank_unpickles_a_broadcast():
    """Text between ranks travels as bytes in tensors; torch's object collectives are refused."""
    from hpc.dist import rules
    from hpc.dist.planes import broadcast_text

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, True, TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=TIMEOUT)
    try:
        for text in (None, "", "runs/ckpt/step_000040", "naïve/ünïcode ✓"):
            assert broadcast_text(text, None) == text
        rules.install()
        with pytest.raises(rules.NCCLRuleError, match="unpickles what a peer sent"):
            dist.broadcast_object_list(["x"], src=0)
    finally:
        dist.destroy_process_group()
