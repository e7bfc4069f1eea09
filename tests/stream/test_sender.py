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


def _groups(tmp_path, ledgers, n=12, b_takes=4):
    mp.start_processes(sender_worker.groups, args=(free_port(), str(tmp_path), ledgers, n, b_takes), nprocs=3,
                       start_method="spawn")
    return [json.loads((tmp_path / f"groups{r}.json").read_text()) for r in range(3)]


def test_two_groups_each_get_every_sample_their_ledger_lacks_from_one_capture(tmp_path):
    # A resumed after samples 0 and 1, B after 0, 1 and 2: nobody needs 0 and 1 again.
    a, b, streamer = _groups(tmp_path, {"0": [[0, 0], [0, 1]], "1": [[0, 0], [0, 1], [0, 2]]})
    assert streamer["fatal"] is None and streamer["common_ledger"] == [[0, 0], [0, 1]]
    assert streamer["captured"] == list(range(2, 12))  # each sample captured once for both drafts
    assert [i for i, _ in a["got"]] == list(range(2, 12)) and all(ok for _, ok in a["got"])
    # B never gets what its ledger holds; it finished after 4 and A went on alone.
    assert [i for i, _ in b["got"]] == [3, 4, 5, 6] and all(ok for _, ok in b["got"])
    per_trainer = {int(t): k for t, k in streamer["per_trainer"].items()}
    assert per_trainer[0] == 10 and 4 <= per_trainer[1] <= 9
    assert streamer["sent"] == 10 and streamer["bytes"] == 1024 * sum(per_trainer.values())
    # Staged once: 2 in flight per trainer, shared by both, so never more than 2 samples' buffers
    # (1024 B each; gloo sends from the staged tensors) at once, where staging per trainer holds 4.
    assert 0 < streamer["host"] <= 2 * 1024
