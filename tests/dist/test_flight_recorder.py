"""The NCCL error handling and flight recorder a training rank sets before its first group."""

from __future__ import annotations

import os

from hpc.dist.planes import flight_recorder_env
from hpc.own_env import RECORD, foreign_environ

VARS = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


def _clean(monkeypatch) -> None:
    for name in (*VARS, RECORD):  # set, then removed: monkeypatch restores them after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_nccl_ranks_dump_under_the_job_logs_and_keep_a_sites_setting(tmp_path, monkeypatch):
    _clean(monkeypatch)
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "5000")  # the site's choice stays
    flight_recorder_env(tmp_path / "logs", "nccl")
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "logs" / "nccl-trace-rank")
    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "5000"
    assert (tmp_path / "logs").is_dir()
    assert not any(name in foreign_environ() for name in VARS)  # and vLLM sees none of them


def test_gloo_ranks_set_nothing(tmp_path, monkeypatch):
    _clean(monkeypatch)
    flight_recorder_env(tmp_path / "logs", "gloo")
    assert not any(name in os.environ for name in VARS) and not (tmp_path / "logs").exists()
