"""The NCCL rules checker: each rule on its own, and the pre-planes stream pattern caught."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import threading
import types

import pytest
import torch

from hpc.dist import rules
from hpc.dist.rules import Checker, Message, NCCLRuleError, Plane
from hpc.net import free_port

pytestmark = pytest.mark.nccl_violations_expected


@pytest.fixture
def checker():
    c = Checker()
    data, control = object(), object()
    c.register(data, Plane.DATA, "cuda")
    c.register(control, Plane.CONTROL, "cpu")
    return c, data, control


def test_checked_mode_is_on_in_tests():
    assert rules.enabled() and rules.installed()
    from torch.distributed import distributed_c10d as c10d
    assert c10d.isend is torch.distributed.isend and c10d.all_reduce is torch.distributed.all_reduce


def test_receive_from_any_source_is_refused(checker):
    c, _, control = checker
    with pytest.raises(NCCLRuleError, match="any source"):
        c.before_p2p("recv", torch.zeros(8, dtype=torch.int64), control, None)
    c.before_p2p("recv", torch.zeros(8, dtype=torch.int64), control, 3)  # a named peer is fine


def test_control_message_on_the_data_plane_and_samples_on_the_control_plane(checker):
    c, data, control = checker
    with pytest.raises(NCCLRuleError, match="control message or bookkeeping op on the data plane"):
        c.before_p2p("send", torch.zeros(8, dtype=torch.int64, device="meta"), data, 1)
    with c.message(Message.SAMPLE), pytest.raises(NCCLRuleError, match="sample tensors on the control plane"):
        c.before_p2p("send", torch.zeros(4), control, 1)
    c.before_p2p("send", torch.zeros(8, dtype=torch.int64), control, 1)  # the right plane


def test_collective_with_tensors_of_another_device_type(checker):
    c, data, control = checker
    with c.message(Message.SAMPLE), pytest.raises(NCCLRuleError, match="cpu tensor on a data-plane group"):
        c.before_collective("all_reduce", [torch.zeros(1)], data)
    with pytest.raises(NCCLRuleError, match="meta tensor on a control-plane group that takes cpu"):
        c.before_collective("all_reduce", [torch.zeros(1, device="meta")], control)
    c.before_collective("all_reduce", [torch.zeros(1)], control)


def test_one_thread_per_pair_on_the_data_plane_until_it_hands_over(checker):
    c, _, _ = checker
    data = object()
    c.register(data, Plane.DATA, "cpu")
    c.enter_stream(object())  # receives run on a side stream (hpc.dist.streams), in every thread below
    with c.message(Message.SAMPLE):
        c.before_p2p("recv", torch.zeros(4), data, 5)  # this thread now owns the pair with rank 5
    errors = []

    def other_thread():
        c.enter_stream(object())
        with c.message(Message.SAMPLE):
            try:  # even after the first op returned: NCCL's calls return once queued
                c.before_p2p("recv", torch.zeros(4), data, 5)
            except NCCLRuleError as err:
                errors.append(str(err))
            c.before_p2p("recv", torch.zeros(4), data, 6)  # another peer is fine
    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert len(errors) == 1 and "another thread owns this pair" in errors[0]
    c.handover(data, 5)  # e.g. the pair warm-up in the main thread, then the receive thread

    tokens = []

    def receive_thread():
        c.enter_stream(object())
        with c.message(Message.SAMPLE):
            c.before_p2p("recv", torch.zeros(4), data, 5)
        tokens.append(c.thread_token())
    t = threading.Thread(target=receive_thread)
    t.start()
    t.join()
    assert c.owned(data, 5) and c.owners[(data, 5)] == tokens[0] != c.thread_token()
    with c.message(Message.SAMPLE), pytest.raises(NCCLRuleError, match="other direction"):
        c.handover(data, 5)
        c.before_p2p("send", torch.zeros(4), data, 5)


def test_the_pre_planes_stream_pattern_is_caught(tmp_path):
    from tests.dist import old_pattern_worker

    log = os.environ[rules.LOG_ENV]
    start = os.path.getsize(log) if os.path.exists(log) else 0
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=old_pattern_worker.main, args=(r, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    for r in range(2):
        send_err, reduce_err = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert "another thread owns this pair" in send_err  # finding 2: the deadlock
        assert "control message or bookkeeping op on the data plane" in send_err
        assert "cpu tensor on a data-plane group that takes cuda" in reduce_err  # finding 1
    with open(log) as fh:  # this test's lines only, written by the rank processes themselves
        fh.seek(start)
        lines = [ln for ln in fh.read().splitlines() if "another thread owns this pair" in ln]
    assert {ln.split()[1] for ln in lines} == {str(p.pid) for p in procs}


def test_a_new_thread_that_inherits_an_exited_owners_id_does_not_inherit_its_pair(checker, monkeypatch):
    """CPython reuses a finished thread's ident: the checker's identity must not."""
    c, _, _ = checker
    data = object()
    c.register(data, Plane.DATA, "cpu")
    # Every thread looks alike by ident to the checker's module, as an ident reused after exit would.
    shim = types.SimpleNamespace(get_ident=lambda: 42, local=threading.local, Lock=threading.Lock,
                                 current_thread=threading.current_thread)
    monkeypatch.setattr(rules, "threading", shim)
    errors = []

    def op():
        c.enter_stream(object())
        with c.message(Message.SAMPLE):
            try:
                c.before_p2p("recv", torch.zeros(4), data, 5)
            except NCCLRuleError as err:
                errors.append(str(err))
    for _ in range(2):  # the first owns the pair and exits without handing it over
        t = threading.Thread(target=op)
        t.start()
        t.join()
    assert len(errors) == 1 and "another thread owns this pair" in errors[0]


def test_p2pop_and_direct_c10d_calls_are_checked_without_false_alarms(tmp_path):
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    group = c10d._get_default_group()
    try:
        op = dist.P2POp(dist.isend, torch.ones(2), 0)  # torch accepts only its own isend: the wrapper must pass
        assert op.op.__name__ == "isend" and c10d.P2POp(c10d.irecv, torch.ones(2), 0).op.__name__ == "irecv"
        rules.register(group, Plane.DATA, "cuda")
        with pytest.raises(NCCLRuleError, match="cpu tensor on a data-plane group"):
            c10d.all_reduce(torch.ones(1), group=group)  # the c10d namespace is not a way around the rules
        with pytest.raises(NCCLRuleError, match="unpickles"):
            c10d.broadcast_object_list([1], group=group)
    finally:
        rules.CHECKER.groups.pop(group, None)
        dist.destroy_process_group()


def test_a_data_plane_receive_outside_a_receive_stream_is_refused(checker):
    """On CUDA it would run on the default stream, behind the trainer's compute: the deadlock the
    receive thread's side stream exists to prevent. On CPU no stream exists, so the checker keeps it."""
    c, data, _ = checker
    with c.message(Message.SAMPLE), pytest.raises(NCCLRuleError, match="outside a RecvStream"):
        c.before_p2p("recv", torch.zeros(4, device="cuda" if torch.cuda.is_available() else "meta"), data, 1)


def test_a_buffer_handed_on_before_its_stream_is_synchronised_is_refused(checker):
    from hpc.dist.streams import RecvStream

    c, data, _ = checker
    c.register(data, Plane.DATA, "cpu")
    buf = torch.zeros(16)
    stream = RecvStream(torch.device("cpu"))
    c.enter_stream(stream)
    with c.message(Message.SAMPLE):
        c.before_p2p("recv", buf[8:], data, 1)  # a view: the pending storage is the buffer's
    with pytest.raises(NCCLRuleError, match="handed on before that stream was synchronised"):
        c.handoff([buf[:4]], "sample 3")
    c.stream_synced(stream)
    c.handoff([buf[:4]], "sample 3")  # after the wait: fine
    c.leave_stream()


def test_a_host_tensor_is_on_the_data_device_only_where_our_code_placed_it(checker):
    """Under gloo the data plane carries host memory, but it stands for NCCL's: a tensor made
    anywhere but through the data device's placement would be a CPU tensor on a cluster."""
    import gc

    c, data, _ = checker
    with c.message(Message.SAMPLE):
        with pytest.raises(NCCLRuleError, match="cpu tensor on a data-plane group that takes cuda"):
            c.before_collective("all_reduce", [torch.zeros(4)], data)
        buf = torch.zeros(64)
        c.place(buf)
        c.before_collective("all_reduce", [buf], data)
        view = buf[8:16]
        del buf
        gc.collect()
        c.before_p2p("send", view, data, 1)  # a view of a placed buffer outlives its base
        del view
        gc.collect()
        assert len(c.placed) == 0  # freed storages are forgotten: a reused address is not placed
        with pytest.raises(NCCLRuleError, match="cpu tensor on a data-plane group"):
            c.before_p2p("send", torch.zeros(64)[8:16], data, 1)


def test_init_planes_checks_the_gloo_data_plane_as_nccl():
    import torch.distributed as dist

    from hpc.dist.planes import init_planes
    from hpc.dist.rendezvous import new_secret

    planes = init_planes(0, 1, [0], "gloo", torch.device("cpu"), "127.0.0.1", free_port(), new_secret(),
                         timeout_s=30)
    try:
        with rules.message(Message.SAMPLE):
            with pytest.raises(NCCLRuleError, match="cpu tensor on a data-plane group that takes cuda"):
                dist.all_reduce(torch.ones(4), group=planes.train_data)
            placed = planes.place(torch.ones(4))
            dist.all_reduce(placed, group=planes.train_data)
            assert placed.tolist() == [1.0] * 4
            dist.all_reduce(planes.empty(2, 3, dtype=torch.bfloat16).zero_(), group=planes.train_data)
        dist.all_reduce(torch.ones(1), group=planes.train_control)  # the control plane takes host tensors
    finally:
        dist.destroy_process_group()
