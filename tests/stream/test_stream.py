"""Streaming verifier states to DDP trainers over gloo: real processes, real sockets."""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import signal
import time

import pytest

from hpc.errors import EXIT_DRAFT_FAILED
from hpc.net import free_port
from hpc.train.epochs import epoch_order
from hpc.train.trainer_rank import EXIT_PEER_DIED
from tests.fixtures.wait import wait_until
from tests.stream import stream_worker
from tests.train.test_resume import target_dir  # noqa: F401 - module fixture: a random Qwen3 target

pytestmark = pytest.mark.slow  # multi-process training over gloo


def launch(T, V, target, out, n_rows, **kw):
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=stream_worker.main, args=(r, T, V, port, str(target), str(out), n_rows), kwargs=kw)
             for r in range(T + V)]
    for p in procs:
        p.start()
    return procs


def wait_all(procs, timeout=300):
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(1, deadline - time.monotonic()))
        assert not p.is_alive(), "a rank hung"
    return [p.exitcode for p in procs]


def read(out, name):
    return json.loads((out / name).read_text())


def test_two_verifiers_feed_two_trainers_each_sample_once(target_dir, tmp_path):  # noqa: F811
    codes = wait_all(launch(2, 2, target_dir, tmp_path, 32, corrupt_id=5))
    assert codes == [0, 0, 0, 0]
    t0, t1 = read(tmp_path, "trainer0.json"), read(tmp_path, "trainer1.json")
    s2, s3 = read(tmp_path, "streamer2.json"), read(tmp_path, "streamer3.json")
    assert t0["ledger"] == t1["ledger"]  # one global ledger
    ledger = [i for _, i in t0["ledger"]]
    assert len(ledger) == len(set(ledger))  # no sample trained twice
    # The corrupt capture cost one sample; its streamer reported it, so the ledger counts it as done
    # (never trained: samples_seen leaves it out), and every trainer heard of it.
    assert s2["failed"] + s3["failed"] == 1 and 5 in ledger
    assert t0["skipped"] == t1["skipped"] == 1 and t0["seen"] == len(ledger) - 1
    # 31 good samples, 4 per step: every complete step's samples were trained, at most one step short.
    assert t0["seen"] % 4 == 0 and 31 - t0["seen"] < 8
    # Both verifiers fed both trainers, and no trainer buffered more than its credit allows.
    assert all(n > 0 for s in (s2, s3) for n in s["per_trainer"].values())
    assert max(t0["max_depth"], t1["max_depth"]) <= 3 * 1 + 3  # buffer_per_trainer (+ one per streamer share)


def test_one_stream_trains_drafts_each_as_its_solo_run_and_a_failed_one_fails_alone(target_dir, tmp_path):  # noqa: F811
    """One verifier, four groups of one trainer, each its own draft: each sample is captured once and
    trained by each; the second draft's losses are bit-identical to its solo run. The third draft's
    lr (1e30) makes its loss NaN, and the fourth's trainer is killed at step 2: each fails alone,
    and the first two train every sample, as if they had shared the stream with nobody."""
    shared, solo = tmp_path / "shared", tmp_path / "solo"
    codes = wait_all(launch(4, 1, target_dir, shared, 24, groups=4, lrs=[1e-3, 3e-3, 1e30, 1e-3], steps=6,
                            die_at={3: 2}))
    assert codes == [0, 0, EXIT_DRAFT_FAILED, -signal.SIGKILL, 0]
    assert wait_all(launch(1, 1, target_dir, solo, 24, lrs=[3e-3], steps=6)) == [0, 0]
    g0, g1 = read(shared / "group0", "trainer0.json"), read(shared / "group1", "trainer1.json")
    streamer = read(shared, "streamer4.json")
    assert streamer["sent"] == 24 and streamer["per_trainer"]["0"] == streamer["per_trainer"]["1"] == 24
    assert g0["ledger"] == g1["ledger"] and len(g0["losses"]) == len(g1["losses"]) == 6
    assert g1["losses"] == read(solo, "trainer0.json")["losses"]  # float hex, every step
    assert g0["losses"] != g1["losses"]  # two drafts, not one trained twice

    # The NaN draft stopped before its optimizer stepped on the NaN, and said so; the killed one
    # was dropped from the stream by the streamer, naming its trainer.
    nan = read(shared / "group2", "stopped.json")
    assert "loss nan" in nan["cause"] and "train.lr" in nan["cause"] and nan["step"] < 6, nan
    assert all(math.isfinite(float.fromhex(x)) for x in read(shared / "group2", "trainer2.json")["losses"])
    assert list(streamer["dropped"]) == ["3"] and "trainer rank 3 is gone" in streamer["dropped"]["3"]
    assert streamer["per_trainer"]["3"] < 24


def test_a_peer_that_stops_mid_sample_ends_the_run_within_the_data_timeout(target_dir, tmp_path):  # noqa: F811
    """The streamer sends a sample's header and ids, then holds its states while alive. The data
    plane's timeout (stream.nccl_timeout_s, 5 s here) ends the wait, well before the 90 s a silent
    peer gets, and the run stops with one line naming the streamer and the timeout."""
    t0 = time.monotonic()
    procs = launch(1, 1, target_dir, tmp_path, 24, peer_timeout_s=90.0, nccl_timeout_s=5.0, stall_after=6)
    try:
        codes = wait_all(procs[:1], timeout=80)
    finally:
        procs[1].kill()
    assert codes == [EXIT_PEER_DIED]
    assert time.monotonic() - t0 < 85  # not the silence watchdog's 90 s
    cause = read(tmp_path, "stopped.json")["cause"]
    assert "\n" not in cause and "rank 1" in cause and "stream.nccl_timeout_s" in cause, cause
    assert read(tmp_path, "trainer0.json")["step"] >= 1  # the samples before the stall trained


def test_killed_verifier_is_noticed_and_a_restart_loses_nothing(target_dir, tmp_path):  # noqa: F811
    procs = launch(2, 1, target_dir, tmp_path, 48, peer_timeout_s=5.0)
    progress = tmp_path / "progress0"
    wait_until(lambda: progress.exists() and int(progress.read_text()) >= 2, 240, 0.2, "training started")
    os.kill(procs[2].pid, signal.SIGKILL)
    # Noticed, not waited out: wait_all fails on a rank still alive after 120 s, four times the
    # 30 s a silent peer gets by default; rank 0 records where it stopped.
    codes = wait_all(procs[:2], timeout=120)
    assert codes == [EXIT_PEER_DIED, EXIT_PEER_DIED]
    assert read(tmp_path, "stopped.json")["cause"]
    first = read(tmp_path, "trainer0.json")
    assert first["step"] >= 2 and len(first["ledger"]) == 4 * first["step"]

    for name in ("trainer0.json", "trainer1.json", "progress0"):
        (tmp_path / name).unlink(missing_ok=True)
    codes = wait_all(launch(2, 1, target_dir, tmp_path, 48))
    assert codes == [0, 0, 0]
    final = read(tmp_path, "trainer0.json")["ledger"]
    assert final[: len(first["ledger"])] == first["ledger"]  # the restart continued the same epoch
    assert len(final) == len(set(map(tuple, final)))  # nothing twice
    # Nothing lost on the way: what never trained is the end of the data only. Trainers step
    # together, so the last samples each one holds (at most its credit, stream.buffer_per_trainer
    # = 3, plus one) wait for a step that does not come; a sample lost mid-run would sit earlier.
    order = epoch_order(list(range(48)), 3, 0)  # the one streamer's send order (streamer_rows, seed 3)
    missing = set(order) - {i for _, i in final}
    assert missing <= set(order[-2 * (3 + 1):]), (sorted(order.index(i) for i in missing), len(final))
