"""open_pairs warms each streamer -> trainer pair with a sample-sized message and the trainers'
DDP group with a bucket-sized all-reduce, so large-message setup is not left to step 1."""

from __future__ import annotations

import json

import torch.multiprocessing as mp

from hpc.net import free_port
from tests.dist import warmup_worker


def test_pairs_carry_a_sample_sized_message_and_trainers_all_reduce_a_bucket(tmp_path):
    mp.start_processes(warmup_worker.main, args=(3, free_port(), str(tmp_path)), nprocs=3, start_method="spawn")
    trainer0, trainer1, streamer = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3))
    for trainer in (trainer0, trainer1):
        assert ["recv", 300_000] in trainer and ["all_reduce", 4096] in trainer
    assert streamer.count(["send", 300_000]) == 2  # one per trainer
    assert not any(op == "all_reduce" for op, _ in streamer)
