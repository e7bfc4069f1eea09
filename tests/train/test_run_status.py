"""Trainer rank 0's MLflow run never stays RUNNING: an exception ends it FAILED (KILLED for an
interrupt) with its buffer sent, before rank_process's os._exit. The world, the draft and the
logger are stand-ins; the end-to-end kill is tests/train/test_verifier_failures.py (slow)."""

from __future__ import annotations

import signal

import pytest
import torch

from hpc.config.schema import DSparkConfig
from hpc.train import ranks, trainer_rank
from hpc.train import train_report as report


class FakeLogger:
    made: list[FakeLogger] = []

    def __init__(self, *args, **kwargs):
        self.statuses: list[str | None] = []
        FakeLogger.made.append(self)

    def log_params(self, params): ...

    def log_metrics(self, metrics, step): ...

    def log_artifact(self, path, artifact_path=None): ...

    @property
    def closed(self) -> bool:
        return bool(self.statuses)

    def close(self, timeout_s: float = 30.0, status: str | None = None) -> bool:
        self.statuses.append(status)
        return True


@pytest.fixture
def rank0(tmp_path, monkeypatch):
    """rank_main on trainer rank 0 of a 1 + 1 world, up to run_trainer (which the test sets); the
    trainer itself is not built."""
    FakeLogger.made.clear()
    cfg = DSparkConfig()
    cfg.train.output_dir = str(tmp_path / "train")
    (tmp_path / "train").mkdir()
    monkeypatch.setattr(ranks, "rank_device", lambda device, exclusive: torch.device("cpu"))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    monkeypatch.setattr(signal, "signal", lambda sig, handler: None)  # the test process keeps its handlers
    monkeypatch.setattr(ranks, "init_world", lambda *a, **k: None)
    monkeypatch.setattr(ranks, "load_prepared", lambda out: ({}, None))
    monkeypatch.setattr(trainer_rank.Trainer, "from_config", classmethod(lambda cls, *a, **k: None))
    monkeypatch.setattr(report, "RunLogger", FakeLogger)
    monkeypatch.setattr(report, "common_tags", lambda cfg: {})
    monkeypatch.setattr(report, "Progress", lambda *a: type("P", (), {"close": lambda self: None})())
    return cfg


def _trainer_raising(err: BaseException):
    def run_trainer(*args, **kwargs):
        raise err
    return run_trainer


@pytest.mark.parametrize("err,status", [(RuntimeError("a peer died"), "FAILED"), (KeyboardInterrupt(), "KILLED")])
def test_an_exception_on_rank_0_ends_its_run(rank0, monkeypatch, err, status):
    monkeypatch.setattr(trainer_rank, "run_trainer", _trainer_raising(err))
    with pytest.raises(type(err)):
        ranks.rank_main(0, rank0, 1, 1, "127.0.0.1", 1, "s" * 64)
    assert [log.statuses for log in FakeLogger.made] == [[status]]


def test_an_error_after_the_run_was_closed_does_not_end_it_twice(rank0, monkeypatch):
    monkeypatch.setattr(trainer_rank, "run_trainer", lambda *a, **k: 0)

    def finish(self, export=True, status="FINISHED"):
        self.logger.close(status=status)
        raise OSError("disk full while printing")
    monkeypatch.setattr(report.TrainReport, "finish", finish)
    with pytest.raises(OSError):
        ranks.rank_main(0, rank0, 1, 1, "127.0.0.1", 1, "s" * 64)
    assert [log.statuses for log in FakeLogger.made] == [["FINISHED"]]


def test_progress_counts_from_the_step_this_job_resumed_at(monkeypatch):
    p = report.Progress(10_000, 64)
    try:
        t0 = p.t0
        monkeypatch.setattr(report.time, "monotonic", lambda: t0 + 2.0)  # the clock Progress reads, frozen
        first = p.update(5001, {})  # two seconds in, the first step after resuming from step 5000 ends
        assert first["samples_per_s"] == pytest.approx(32.0)  # one step of 64 samples in 2 s
        assert first["eta_s"] == pytest.approx(2.0 * 4999)  # not 5000 steps in 2 s
    finally:
        p.close()


def test_progress_is_the_steady_rate_once_the_first_step_has_ended(monkeypatch):
    """The first step holds the verifier's start and the first sample's wait: from the second
    step on, neither weighs on samples/s, the data-wait share or the ETA."""
    p = report.Progress(100, 8)
    try:
        t0, now = p.t0, [0.0]
        monkeypatch.setattr(report.time, "monotonic", lambda: t0 + now[0])
        now[0] = 30.0  # a verifier that took 29 s to start, waited for all the while
        assert p.update(1, {"data_wait_s": 29.0})["samples_per_s"] == pytest.approx(8 / 30)
        now[0] = 40.0  # 10 more steps in 10 s, 2.5 s of it waiting for data
        later = p.update(11, {"data_wait_s": 31.5})
        assert later["samples_per_s"] == pytest.approx(8.0) and later["data_wait_fraction"] == pytest.approx(0.25)
        assert later["eta_s"] == pytest.approx(89.0)
    finally:
        p.close()


def test_a_failure_while_the_run_is_being_set_up_ends_it(rank0, monkeypatch):
    """The run exists from the logger's first line: an error logging the params must not leave it RUNNING."""
    def broken(self, params):
        raise OSError("disk full writing the params")
    monkeypatch.setattr(FakeLogger, "log_params", broken)
    monkeypatch.setattr(trainer_rank, "run_trainer", lambda *a, **k: 0)
    with pytest.raises(OSError):
        ranks.rank_main(0, rank0, 1, 1, "127.0.0.1", 1, "s" * 64)
    assert [log.statuses for log in FakeLogger.made] == [["FAILED"]]
