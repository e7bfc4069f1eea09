"""The streamer's sends overlap: samples in flight per trainer, sends to different trainers side
by side, and heartbeats that do not wait behind a data send (real gloo processes)."""

from __future__ import annotations

import json

import torch.multiprocessing as mp

from hpc.net import free_port
from tests.stream import sender_worker


def _run(fn, tmp_path, name):
    mp.start_processes(fn, args=(free_port(), str(tmp_path)), nprocs=3, start_method="spawn")
    return [json.loads((tmp_path / f"{name}{r}.json").read_text()) for r in range(3)]


def test_two_samples_per_trainer_are_on_the_wire_before_either_trainer_receives(tmp_path):
    a, b, streamer = _run(sender_worker.windows, tmp_path, "windows")
    # Four sends returned while both trainers sat at a barrier: nothing waited for a receive.
    assert streamer["posted"] == 4 and streamer["windows"] == [2, 2]
    assert streamer["host"] > 0
    assert a["got"] == [[0, "torch.bfloat16", True], [1, "torch.bfloat16", True]]  # the capture's dtype, intact
    assert b["got"] == [[2, "torch.bfloat16", True], [3, "torch.bfloat16", True]]


def test_heartbeats_go_out_while_the_main_thread_waits_for_a_window(tmp_path):
    a, b, _ = _run(sender_worker.beats, tmp_path, "beats")
    assert "HEARTBEAT" in b["seen"] and b["seen"][-1] == "STOP"
    assert a["seen"].count("SAMPLE") == 2 and a["seen"][-1] == "STOP"
