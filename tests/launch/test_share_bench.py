"""`dspark bench share`: what it submits, what it refuses before submitting, and its table. The
bench itself runs on a cluster (its figures are in docs/shared-cluster.md); Slurm's answers are
mocked here for the error paths only."""

from __future__ import annotations

import pytest

from hpc.config.shared_sweep import train_nodes
from hpc.errors import UserError
from hpc.launch import share_bench
from tests.fixtures.recipes import KIMI, NO_VLLM, resolve_recipe

BASE = [*NO_VLLM, "cluster.account=a"]


def test_the_shared_run_is_the_lone_one_with_k_lrs_on_one_verifier():
    solo, shared = share_bench.plans(str(KIMI), BASE, 3, 40)
    assert shared[:len(solo)] == solo and "train.steps=40" in solo
    one, three = resolve_recipe(KIMI, solo), resolve_recipe(KIMI, shared)
    assert not one.sweep and three.submit.share_verifier
    lr = one.train.lr
    assert list(three.sweep["train.lr"]) == pytest.approx([lr, lr / 2, lr / 4])  # a step costs the same at any lr
    c = one.cluster
    assert train_nodes(three) == c.verifier_nodes + 3 * c.trainer_nodes  # one allocation: V + K x T nodes


@pytest.mark.parametrize("extra, groups, says", [
    ([], 1, "between 2 and 8 drafts"),
    (["sweep={train.lr: [1e-4, 2e-4]}"], 3, "makes its own sweep"),
    (["submit.ablations=true"], 3, "makes its own sweep"),
])
def test_what_the_bench_refuses_before_submitting(extra, groups, says):
    with pytest.raises(UserError, match=says):
        share_bench.plans(str(KIMI), [*BASE, *extra], groups, 40)


def test_the_table_is_each_drafts_rate_against_the_lone_one():
    alone = {"samples_per_s": 10.0, "data_wait_fraction": 0.5}
    shared = [{"samples_per_s": 9.5, "data_wait_fraction": 0.25}, {"samples_per_s": 8.0}]
    lines, ratios = share_bench.table(alone, shared, ["v0 train.lr=0.001", "v1 train.lr=0.0005"])
    assert ratios == pytest.approx([0.95, 0.8])
    assert lines[0].split() == ["run", "samples/s", "data", "wait", "shared", "/", "alone"]
    assert lines[1].split() == ["alone", "10.00", "50%"]
    assert lines[2].split() == ["v0", "train.lr=0.001", "9.50", "25%", "0.95"]
    assert lines[3].split() == ["v1", "train.lr=0.0005", "8.00", "-", "0.80"]  # no wait figure: none made up


class FakeJob:
    def __init__(self, states: list[str]):
        self.states, self.job_id = states, "42"
        self.paths = type("Paths", (), {"stdout": "/logs/42_0_log.out"})()

    @property
    def state(self) -> str:
        return self.states.pop(0) if len(self.states) > 1 else self.states[0]


def test_a_job_that_fails_or_runs_over_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(share_bench.time, "sleep", lambda s: None)
    with pytest.raises(UserError, match=r"the alone job 42 ended FAILED; its log: /logs/42_0_log.out"):
        share_bench.wait_job(FakeJob(["PENDING", "RUNNING", "FAILED"]), [tmp_path], 3600, "alone")
    # submitit reads a job whose tasks ended but whose epilog runs as done: the bench waits for Slurm's end
    share_bench.wait_job(FakeJob(["RUNNING", "RUNNING", "COMPLETED"]), [tmp_path], 3600, "alone")
    cancelled: list[list[str]] = []
    monkeypatch.setattr(share_bench, "cancel", cancelled.append)
    clock = iter(range(0, 10_000, 100))
    monkeypatch.setattr(share_bench.time, "monotonic", lambda: float(next(clock)))
    with pytest.raises(UserError, match="ran over --timeout-s 250; cancelled it"):
        share_bench.wait_job(FakeJob(["RUNNING"]), [tmp_path], 250, "shared by 3")
    assert cancelled == [["42"]]
