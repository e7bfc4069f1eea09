"""The verifier's shared last GPU in EXCLUSIVE_PROCESS mode is one line before anything starts
(nvidia-smi mocked: this machine has none)."""

from __future__ import annotations

import subprocess

import pytest

from hpc.errors import UserError
from hpc.launch.gpu_mode import check_shared_gpu


def _smi(stdout: str, rc: int = 0):
    calls = []

    def run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, rc, stdout=stdout, stderr="")
    return run, calls


def test_exclusive_process_is_refused_in_one_line(monkeypatch):
    run, calls = _smi("Exclusive_Process\n")
    monkeypatch.setattr(subprocess, "run", run)
    with pytest.raises(UserError) as err:
        check_shared_gpu(7)
    assert calls == [["nvidia-smi", "-i", "7", "--query-gpu=compute_mode", "--format=csv,noheader"]]
    assert "\n" not in str(err.value) and "GPU 7" in str(err.value) and "Exclusive_Process" in str(err.value)


@pytest.mark.parametrize("stdout,rc", [("Default\n", 0), ("Prohibited\n", 9), ("", 6)])
def test_default_mode_or_an_unreadable_answer_passes(monkeypatch, stdout, rc):
    monkeypatch.setattr(subprocess, "run", _smi(stdout, rc)[0])
    check_shared_gpu(0)


def test_no_nvidia_smi_passes(monkeypatch):
    def missing(cmd, **kw):
        raise FileNotFoundError(cmd[0])
    monkeypatch.setattr(subprocess, "run", missing)
    check_shared_gpu(0)
