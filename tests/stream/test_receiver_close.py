"""`StreamReceiver.close` notices a dead streamer by the clock, even when its control thread
is stuck (in a send to that very peer, as gloo can be for a whole group timeout)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from hpc.stream.receiver import StreamReceiver


def _receiver(peer_timeout_s: float) -> StreamReceiver:
    # No start(): no control thread ever sets `_done`, as if it were blocked.
    return StreamReceiver([2, 3], capacity=4, planes=SimpleNamespace(device=torch.device("cpu")),
                          peer_timeout_s=peer_timeout_s, names={2: "streamer rank 2 (verifier node 0)"})


def test_a_silent_streamer_ends_the_wait_and_is_named():
    r = _receiver(peer_timeout_s=0.5)
    r._last_seen[2] -= 10  # silent for 10 s; rank 3 just heard from
    assert r.close(timeout_s=30) is False
    assert r.error.startswith("streamer rank 2 (verifier node 0) sent nothing for 0 s")


def test_a_streamer_that_said_stop_may_be_silent():
    r = _receiver(peer_timeout_s=0.5)
    r._last_seen[2] -= 10
    r._said_stop.add(2)  # it ended its stream: silence is expected, rank 3 is awaited
    assert r.close(timeout_s=0.3) is False  # gave up on the timeout, not on rank 2
    assert r.error is None
