"""The receive thread's side stream and its wait, kept honest on CPU: take either out of the real
StreamReceiver and the checker refuses it (hpc.dist.streams)."""

from __future__ import annotations

import json
import multiprocessing as mp
import time

import pytest

from hpc.net import free_port
from tests.stream import mutation_worker


def _run(tmp_path, mutation: str) -> dict:
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=mutation_worker.main, args=(r, port, str(tmp_path), mutation)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        procs[0].join(120)
        assert procs[0].exitcode == 0, "the trainer rank did not finish"
        return json.loads((tmp_path / "trainer.json").read_text())
    finally:
        time.sleep(0.5)
        for p in procs:
            p.kill()
            p.join(10)


def test_the_receiver_as_it_is_takes_both_samples(tmp_path):
    out = _run(tmp_path, "none")
    assert out == {"got": [0, 1], "error": None}


@pytest.mark.nccl_violations_expected
def test_receives_without_the_side_stream_are_refused(tmp_path):
    out = _run(tmp_path, "no_side_stream")
    assert out["got"] == [] and "outside a RecvStream" in out["error"], out


@pytest.mark.nccl_violations_expected
def test_a_sample_handed_to_the_trainer_before_its_stream_is_waited_for_is_refused(tmp_path):
    out = _run(tmp_path, "no_sync")
    assert out["got"] == [] and "handed on before that stream was synchronised" in out["error"], out
