"""Checkpoints are whole or skipped: a damaged newest one falls back to the previous good one."""

from __future__ import annotations

import pytest
import torch

from hpc.formats.checkpoint_layout import TrainState, checkpoint_problem, latest_checkpoint, list_checkpoints
from hpc.train.checkpoint import save_checkpoint


def _save(root, step: int, keep: int = 5):
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    return save_checkpoint(root, model, {"step": step}, opt, TrainState(step=step), None, keep)


def test_saves_are_whole_and_leave_no_temp(tmp_path):
    for step in (10, 20, 30):
        _save(tmp_path, step, keep=2)
    assert [p.name for p in tmp_path.iterdir()] and all(not p.name.startswith(".") for p in tmp_path.iterdir())
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000020", "step_00000030"]
    assert checkpoint_problem(list_checkpoints(tmp_path)[-1]) is None
    _save(tmp_path, 30, keep=2)  # the same step again (a resumed run) replaces it whole
    assert checkpoint_problem(tmp_path / "step_00000030") is None


@pytest.mark.parametrize("damage", ["truncated weights", "missing state", "bad json", "size mismatch"])
def test_a_damaged_latest_checkpoint_falls_back_and_says_so(tmp_path, damage):
    _save(tmp_path, 10)
    last = _save(tmp_path, 20)
    if damage == "truncated weights":
        data = (last / "model.safetensors").read_bytes()
        (last / "model.safetensors").write_bytes(data[:40])
    elif damage == "missing state":
        (last / "state.json").unlink()
    elif damage == "bad json":
        (last / "optimizer.json").write_text("{")
    else:
        with open(last / "rank0.safetensors", "ab") as f:
            f.write(b" ")
    said: list[str] = []
    assert latest_checkpoint(tmp_path, said.append) == tmp_path / "step_00000010"
    assert len(said) == 1 and "step_00000020 is damaged" in said[0] and "falling back to step_00000010" in said[0]


def test_no_good_checkpoint_means_a_fresh_start_said_out_loud(tmp_path):
    last = _save(tmp_path, 10)
    (last / "config.json").unlink()
    said: list[str] = []
    assert latest_checkpoint(tmp_path, said.append) is None
    assert "starting from scratch" in said[0]


@pytest.mark.parametrize("keep", [1, 2])
def test_a_damaged_newer_checkpoint_is_set_aside_not_counted_when_pruning(tmp_path, keep):
    """keep=1, good 100, damaged 200: the run resumes at 100 and saves 150; the prune must keep
    150 (and 100 with keep=2), not the damaged 200 alone."""
    _save(tmp_path, 100)
    damaged = _save(tmp_path, 200)  # keep=1 too: a job that died after the rename, before its prune
    (damaged / "state.json").write_text("{")
    assert latest_checkpoint(tmp_path, lambda _: None) == tmp_path / "step_00000100"
    _save(tmp_path, 150, keep)
    expected = ["step_00000100", "step_00000150"][-keep:]
    assert [p.name for p in list_checkpoints(tmp_path)] == expected
    assert latest_checkpoint(tmp_path, lambda _: None) == tmp_path / "step_00000150"
    assert (tmp_path / ".step_00000200.damaged" / "state.json").read_text() == "{"  # kept to examine


def test_cuda_rng_states_go_back_to_their_own_devices(monkeypatch):
    """Sorted as strings, torch_cuda_10 came before torch_cuda_2; and a node showing fewer GPUs
    than the run that saved indexed past its devices."""
    import torch

    from hpc.train.checkpoint import restore_rng

    restored: list[tuple[int, int]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 11)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, i: restored.append((int(state[0]), i)))
    tensors = {"torch_cpu": torch.get_rng_state(), **{f"torch_cuda_{i}": torch.tensor([i]) for i in range(12)}}
    restore_rng(tensors, None)
    assert restored == [(i, i) for i in range(11)]
