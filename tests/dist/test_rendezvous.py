"""The world's rendezvous store listens on the master address only, not on every interface."""

from __future__ import annotations

import datetime

from hpc.dist.planes import rendezvous_store
from hpc.net import free_port
from tests.fixtures.sockets import listening_addresses


def test_the_store_listens_on_the_master_address_only():
    port = free_port()
    store = rendezvous_store(0, 1, "127.0.0.1", port, datetime.timedelta(seconds=10))
    store.set("k", "v")
    assert store.get("k") == b"v"
    # torch's own store, given a port alone, listens on "*" (every interface of the node).
    assert listening_addresses(port) == {"127.0.0.1"}
