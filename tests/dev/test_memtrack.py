"""hpc_dev.memtrack reads peak live tensor memory on CPU the way the CUDA allocator's peak would."""

from __future__ import annotations

import torch

from hpc_dev.memtrack import PeakMemory, state_tensors


def test_peak_counts_live_storages_once_and_forgets_freed_ones():
    held = torch.zeros(1000)  # 4000 B that exist before the block
    with PeakMemory().track([held, held[:10]]) as m:  # a view shares its storage: counted once
        a = torch.ones(2000)  # +8000
        b = a * 2  # +8000: peak 20000
        del a, b
        c = torch.ones(500)  # after the frees: 4000 + 2000
        view = c[:100]
    assert m.peak == 20000
    assert m.current == 6000 and view.numel() == 100


def test_a_training_step_peak_includes_grads_and_optimizer_state():
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(64, 256)
    model(x).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    start = sum(t.numel() * 4 for t in state_tensors(model, opt))  # weights + exp_avg + exp_avg_sq (+ step)
    with PeakMemory().track(state_tensors(model, opt)) as m:
        model(x).sum().backward()  # grads appear: + weights' size
        opt.step()
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert m.peak >= start + weights
