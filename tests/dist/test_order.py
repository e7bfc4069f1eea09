"""The cross-rank order check (hpc.dist.order): what gloo carries and NCCL would not is found
after the ranks shut down, from what each recorded."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from hpc.dist import order, rules
from hpc.dist.order import _compare_world
from hpc.net import free_port
from tests.dist import order_worker


def _orders() -> Path:
    root = Path(os.environ[rules.LOG_ENV] + order.ORDER_SUFFIX)
    shutil.rmtree(root, ignore_errors=True)
    return root


@pytest.mark.nccl_violations_expected
def test_messages_received_as_each_others_shape_and_dtype_are_found(tmp_path):
    root = _orders()
    mp.start_processes(order_worker.swapped, args=(free_port(), False), nprocs=2, start_method="spawn")
    problems = order.compare(root)
    assert len(problems) == 1, problems
    assert "message #0 from rank 1 to rank 0 is sent as torch.float32 [8] and received as torch.int64 [4]" in problems[0]


def test_the_same_messages_in_order_pass():
    root = _orders()
    mp.start_processes(order_worker.swapped, args=(free_port(), True), nprocs=2, start_method="spawn")
    assert len(list(root.glob("*/rank*.json"))) == 2  # both ranks recorded their ops
    assert order.compare(root) == []


@pytest.mark.nccl_violations_expected
def test_a_first_batch_isend_irecv_without_every_rank_of_the_group_is_found():
    root = _orders()
    mp.start_processes(order_worker.partial_batch, args=(free_port(),), nprocs=3, start_method="spawn")
    problems = order.compare(root)
    assert any("first op is batch_isend_irecv on some ranks, not on ranks [2]" in p for p in problems), problems


def _dump(rank: int, ops: list, clean: bool = True, first: str = "all_reduce") -> dict:
    return {"rank": rank, "clean": clean, "groups": {"1": [0, 1]}, "ops": {"1": ops}, "first": {"1": first}}


def test_collectives_in_another_order_or_count_are_found():
    a = [["coll", "all_reduce", [4], "torch.float32"], ["coll", "all_reduce", [8], "torch.float32"]]
    assert _compare_world({0: _dump(0, a), 1: _dump(1, a)}) == []
    swapped = _compare_world({0: _dump(0, a), 1: _dump(1, a[::-1])})
    assert swapped == ["group 1: collective #0 is ['all_reduce', [4], 'torch.float32'] on rank 0 but "
                       "['all_reduce', [8], 'torch.float32'] on rank 1"]
    assert "rank 0 ran 2 collectives, rank 1 ran 1" in _compare_world({0: _dump(0, a), 1: _dump(1, a[:1])})[0]
    # A rank that stopped early (killed, or on an error path) is compared on what it recorded.
    assert _compare_world({0: _dump(0, a), 1: _dump(1, a[:1], clean=False)}) == []
