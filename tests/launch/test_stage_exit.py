"""A Slurm training node that fails ends with one line naming the cause, and `dspark train` ends
the same way through the same supervision (`hpc.train.ranks`), with the ranks' exit codes
simulated: no ranks, no Slurm, no torch world."""

from __future__ import annotations

import pytest
import torch.multiprocessing as mp

from hpc.config.schema import DSparkConfig
from hpc.errors import UserError
from hpc.launch import stages
from hpc.launch.slurm_env import SlurmEnv
from hpc.train import ranks as rank_supervision
from hpc.train import train_cli


class FakeClock:
    """`time` as the supervisor reads it: a sleep moves the clock instead of waiting."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


class FakeRank:
    """A rank process whose exit code is scripted: `codes` are what successive polls see."""

    def __init__(self, codes: list[int | None]):
        self.codes, self.pid, self.killed = list(codes), 4242, False

    @property
    def exitcode(self) -> int | None:
        return -9 if self.killed else self.codes[0] if len(self.codes) == 1 else self.codes.pop(0)

    def is_alive(self) -> bool:
        return self.exitcode is None

    def kill(self) -> None:
        self.killed = True

    def start(self) -> None: ...

    def join(self, timeout=None) -> None: ...


@pytest.fixture
def node(tmp_path, monkeypatch):
    """Node 1 of a 2-node allocation (verifier node 0, one trainer node of two ranks)."""
    cfg = DSparkConfig()
    cfg.cluster.verifier_nodes, cfg.cluster.trainer_nodes, cfg.cluster.gpus_per_node = 1, 1, 2
    cfg.train.output_dir, cfg.cluster.log_dir = str(tmp_path / "train"), str(tmp_path / "logs")
    monkeypatch.setattr(SlurmEnv, "from_environ", classmethod(lambda cls: SlurmEnv(7, 1, 2, ["a", "b"], "7")))
    monkeypatch.setattr(stages, "prepare_once", lambda cfg, env: None)
    monkeypatch.setattr(stages, "_rendezvous", lambda cfg, env, master_node: ("127.0.0.1", 1, "s" * 64))
    clock = FakeClock()
    monkeypatch.setattr(rank_supervision, "time", clock)
    ranks: list[FakeRank] = []

    class Context:
        def Process(self, target, args, name):  # noqa: N802 - multiprocessing's spelling
            return ranks[int(name.removeprefix("rank"))]
    monkeypatch.setattr(mp, "get_context", lambda method: Context())
    return cfg, ranks


def test_a_rank_killed_by_a_signal_is_named_in_one_line(node):
    cfg, ranks = node
    ranks += [FakeRank([-9]), FakeRank([None, 1])]  # trainer 0 OOM-killed; trainer 1 then lost its peer
    with pytest.raises(UserError) as info:
        stages.train_allocation(cfg)
    line = str(info.value)
    assert "\n" not in line and line.startswith("node 1 (trainer): rank 0 (trainer 0) was killed by SIGKILL"), line
    assert "no checkpoint yet, a re-run starts over" in line, line
    assert info.value.exit_code == 137  # as the shell writes a SIGKILL, not exit(-9) = 247


def test_a_rank_this_node_stopped_is_not_blamed_and_the_resume_is_said(node, tmp_path):
    import torch

    from hpc.formats.checkpoint_layout import TrainState
    from hpc.train.checkpoint import save_checkpoint

    cfg, ranks = node
    model = torch.nn.Linear(2, 2)
    save_checkpoint(tmp_path / "train" / "checkpoints", model, {}, torch.optim.SGD(model.parameters(), lr=0.1),
                    TrainState(step=5), None, keep=2)
    ranks += [FakeRank([1]), FakeRank([None])]  # rank 0 fails; rank 1 hangs until the node kills it
    with pytest.raises(UserError) as info:
        stages.train_allocation(cfg)
    line = str(info.value)
    assert ranks[1].killed and "SIGKILL" not in line, line
    assert rank_supervision.time.now >= rank_supervision.grace_s(cfg)  # it had the grace to stop on its own
    assert "a rank failed" in line and "checkpoint step_00000005 is saved and a re-run resumes from it" in line, line
    assert info.value.exit_code == 1


def test_the_stage_cli_prints_the_cause_as_its_one_error_line(node, monkeypatch, capsys):
    from hpc.cli import main

    cfg, ranks = node
    ranks += [FakeRank([0]), FakeRank([-15])]
    monkeypatch.setattr("hpc.launch.stage_table.check_variant_file", lambda path: None)
    monkeypatch.setattr("hpc.launch.stage_table.resolve", lambda *a, **k: cfg)
    monkeypatch.setattr("hpc.launch.stage_table.localize_stage", lambda c: c)
    assert main(["stage", "train", "variant.yaml"]) == 128 + 15
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [err[0]] and err[0].startswith("error: node 1 (trainer): rank 1 (trainer 1) was killed by SIGTERM"), err


def test_the_requeue_code_is_the_trainers_and_the_launcher_loads_without_torch():
    # One EXIT_REQUEUE for both sides: the launcher module must still import on a login node.
    import subprocess
    import sys

    from hpc.train import trainer_rank

    assert stages.EXIT_REQUEUE == trainer_rank.EXIT_REQUEUE == 75
    probe = "import sys, hpc.launch.stages; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def test_dspark_train_ends_a_failure_as_a_slurm_node_does(node, monkeypatch, capsys, tmp_path):
    """The local launcher supervises with the same code: the first failure stops the rest, and
    the one error line names the rank the kernel killed."""
    cfg, ranks = node
    ranks += [FakeRank([None, -9]), FakeRank([None]), FakeRank([None, None, 3])]  # 2 trainers + 1 streamer
    monkeypatch.setattr(train_cli, "localize", lambda c: c)
    monkeypatch.setattr(train_cli, "prepare_data", lambda c: type("P", (), {"stats": type("S", (), {
        "summary": lambda self: "3 rows kept"})(), "filled": 0})())
    cfg.tracking.uri = f"sqlite:///{tmp_path / 'unused.db'}"  # dspark train creates a new store's tables first
    assert train_cli.train_local(cfg) == 137
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: rank 0 (trainer 0) was killed by SIGKILL"), err
    assert ranks[1].killed and not ranks[2].killed  # the hung trainer was stopped; the streamer had exited


def test_dspark_train_drops_a_failed_draft_and_the_others_finish(node, monkeypatch, capsys, tmp_path):
    """Three drafts share one stream (2 trainer ranks each): the kernel kills a rank of the second.
    Its draft alone is stopped (the hung rank after its grace), the other drafts and the streamer
    finish, and the failed draft gets one line naming it; the command's code says some failed."""
    import copy

    from hpc.errors import EXIT_DRAFT_FAILED

    cfg, ranks = node
    drafts = []
    for i, label in enumerate(("DSpark", "DFlash", "Markov-only")):
        d = copy.deepcopy(cfg)
        d.train.output_dir, d.eval.label = str(tmp_path / f"v{i}"), label
        drafts.append(d)
    done = [None] * 5 + [0]
    ranks += [FakeRank(done), FakeRank(done), FakeRank([None, -9]), FakeRank([None]),  # draft 1: killed, hung
              FakeRank(done), FakeRank(done), FakeRank([None] * 300 + [0])]  # draft 2; the streamer, long after
    monkeypatch.setattr(train_cli, "localize", lambda c: c)
    monkeypatch.setattr(train_cli, "prepare_data", lambda c: type("P", (), {"stats": type("S", (), {
        "summary": lambda self: "3 rows kept"})(), "filled": 0})())
    cfg.tracking.uri = drafts[0].tracking.uri = f"sqlite:///{tmp_path / 'unused.db'}"
    assert train_cli.train_local(drafts[0], variants=drafts) == EXIT_DRAFT_FAILED
    err = [line for line in capsys.readouterr().err.strip().splitlines() if " mlflow." not in line]
    assert err[0].startswith(f"error: variant DFlash ({tmp_path / 'v1'}): rank 2 (trainer 2) was killed by SIGKILL"), err
    assert err[1] == "2 of 3 drafts finished and exported" and len(err) == 2, err
    assert [r.killed for r in ranks] == [False, False, False, True, False, False, False]  # only draft 1's hung rank
    assert rank_supervision.time.now >= rank_supervision.grace_s(cfg)  # it had the grace to stop on its own
    from hpc.formats import draft_failure  # its later stages and `dspark status` read why

    assert draft_failure.read(tmp_path / "v1")["cause"] == err[0].split("): ", 1)[1]
    assert draft_failure.read(tmp_path / "v0") is None and draft_failure.read(tmp_path / "v2") is None


def test_a_streamer_or_a_lone_draft_failing_still_ends_the_world(node):
    # Several drafts: a streamer's failure is everyone's; the drafts' live ranks are stopped after their grace.
    ranks = [FakeRank([None]), FakeRank([None]), FakeRank([None, 4])]
    code, own = rank_supervision.supervise(ranks, 10.0, drafts=[0, 1, -1])
    assert code == 4 and own == [None, None, 4] and ranks[0].killed and ranks[1].killed
    # One draft (no `drafts`): a trainer's failure stops the world, as it always did.
    ranks = [FakeRank([None, 6]), FakeRank([None])]
    code, own = rank_supervision.supervise(ranks, 10.0)
    assert code == 6 and own == [6, None] and ranks[1].killed


def test_a_failed_drafts_later_stages_refuse_in_one_line(node, monkeypatch, capsys):
    """Its evaluation and calibration jobs end FAILED naming why, before any verifier starts."""
    from hpc.cli import main
    from hpc.formats import draft_failure

    cfg, _ = node
    cfg.eval.label = "DFlash"
    monkeypatch.setattr("hpc.launch.stage_table.check_variant_file", lambda path: None)
    monkeypatch.setattr("hpc.launch.stage_table.resolve", lambda *a, **k: cfg)
    monkeypatch.setattr("hpc.launch.stage_table.localize_stage", lambda c: c)
    for entry in ("eval_stage", "calibrate_stage", "adaptive_stage"):
        monkeypatch.setattr(f"hpc.launch.stage_table.{entry}", lambda *a, **k: 0)
    assert main(["stage", "eval", "variant.yaml", "--n", "3"]) == 0  # a draft that trained: the stage runs
    draft_failure.record(cfg.train.output_dir, "DFlash", "rank 2 (trainer 2) was killed by SIGKILL")
    for argv, verb in ((["eval", "--n", "3"], "evaluate"), (["calibrate"], "calibrate"),
                       (["eval-adaptive"], "evaluate")):
        assert main(["stage", argv[0], "variant.yaml", *argv[1:]]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {verb}: variant DFlash's training failed"), err
        assert "rank 2 (trainer 2) was killed by SIGKILL" in err[0]


def test_a_slurm_node_whose_draft_failed_records_it_and_ends_cleanly(node, monkeypatch, capsys, tmp_path):
    """Node 2 of V + 2 x T = 3 nodes trains the second draft (ranks 2 and 3): a rank killed there
    is that draft's alone, so the node's task exits 0 (srun's --kill-on-bad-exit would end the
    other draft's node too) after naming it, and leaves the cause for its stages and status."""
    import copy

    from hpc.formats import draft_failure

    cfg, ranks = node
    monkeypatch.setattr(SlurmEnv, "from_environ", classmethod(lambda cls: SlurmEnv(7, 2, 3, ["a", "b", "c"], "7")))
    drafts = []
    for i, label in enumerate(("DSpark", "DFlash")):
        d = copy.deepcopy(cfg)
        d.train.output_dir, d.eval.label = str(tmp_path / f"v{i}"), label
        drafts.append(d)
    ranks += [None, None, FakeRank([None, -9]), FakeRank([None])]  # ranks 2, 3: this node's
    assert stages.train_allocation(drafts[0], variants=drafts) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: node 2 (trainer of v1): variant DFlash ({tmp_path / 'v1'}): rank 2 (trainer 2) was "
                   "killed by SIGKILL (the kernel's OOM killer does this: check the node's memory); the other ranks "
                   "stopped because they lost it; no checkpoint yet, a re-run starts over"], err
    assert ranks[3].killed and "SIGKILL" in draft_failure.read(tmp_path / "v1")["cause"]
    assert draft_failure.read(tmp_path / "v0") is None


class SignalledRank(FakeRank):
    """The streamer on node 0 when Slurm's USR2 lands: the signal reaches the node's launcher at
    the first poll, then the rank ends cleanly (the trainers checkpointed and said goodbye)."""

    def __init__(self):
        super().__init__([None, 0])
        self.sent = False

    @property
    def exitcode(self) -> int | None:
        if not self.sent:
            import os
            import signal

            self.sent = True
            os.kill(os.getpid(), signal.SIGUSR2)
        return super().exitcode


@pytest.mark.parametrize("v0_finished, requeued", [(False, True), (True, False)])
def test_a_shared_allocations_requeue_is_for_its_live_drafts_only(node, monkeypatch, tmp_path, v0_finished,
                                                                   requeued):
    """Node 0 (the verifier's) of V + 2 x T, preempted after draft v1 failed on its own: it requeues
    while the live draft v0 has steps left, and not once v0 finished (v1's failure is recorded,
    and a requeue would only fail it again)."""
    import copy
    import json

    import torch
    from safetensors.torch import save_file

    from hpc.errors import EXIT_REQUEUE
    from hpc.formats import draft_failure
    from hpc.formats.checkpoint_layout import REQUIRED, step_dir

    cfg, ranks = node
    monkeypatch.setattr(SlurmEnv, "from_environ", classmethod(lambda cls: SlurmEnv(7, 0, 3, ["a", "b", "c"], "7")))
    calls: list[str] = []
    monkeypatch.setattr(stages, "requeue_timed", lambda cfg, fn, code, variants: calls.append(cfg.train.output_dir))
    drafts = []
    for i in range(2):
        d = copy.deepcopy(cfg)
        d.train.output_dir, d.train.steps = str(tmp_path / f"v{i}"), 20
        drafts.append(d)
    step = drafts[0].train.steps if v0_finished else 7
    whole = tmp_path / "v0" / "checkpoints" / step_dir(step)  # a whole checkpoint's files, each parseable
    whole.mkdir(parents=True)
    for name in REQUIRED:
        if name.endswith(".safetensors"):
            save_file({"x": torch.zeros(1)}, str(whole / name))
        else:
            (whole / name).write_text(json.dumps({"step": step}))
    draft_failure.record(tmp_path / "v1", "v1", "training stopped at step 1 of 20: loss nan")
    ranks += [None] * 4 + [SignalledRank()]  # trainers 0..3 on nodes 1 and 2; node 0's streamer is rank 4
    code = stages.train_allocation(drafts[0], variants=drafts)
    assert (code, calls) == ((EXIT_REQUEUE, [str(tmp_path / "v0")]) if requeued else (0, []))


@pytest.mark.parametrize("first", ["killed", "peer"])
def test_a_draft_on_two_nodes_keeps_the_root_cause_whichever_node_records_last(tmp_path, first):
    """Draft v1's ranks 2 and 3 on two trainer nodes: the kernel kills rank 2, and rank 3 fails
    because it lost it. Each node records what its own ranks saw; the kill stays the draft's cause."""
    from hpc.formats import draft_failure

    cfg = DSparkConfig()
    cfg.train.output_dir, cfg.eval.label = str(tmp_path / "v1"), "lr=5e-4"
    # each node passes its own ranks' codes: rank 2's node, then rank 3's (4 trainers, 2 per draft)
    records = {"killed": lambda: rank_supervision.record_draft_failure(cfg, 1, [-9], [1], 4, [2]),
               "peer": lambda: rank_supervision.record_draft_failure(cfg, 1, [1], [1], 4, [3])}
    lines = {who: records[who]() for who in (first, "peer" if first == "killed" else "killed")}
    assert "killed by SIGKILL" in lines["killed"] and "SIGKILL" not in lines["peer"]  # each node's log: its own
    assert draft_failure.read(tmp_path / "v1")["cause"] == lines["killed"].split("): ", 1)[1]
