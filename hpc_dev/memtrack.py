"""Peak live tensor memory on CPU, where torch keeps no allocator statistics.

`torch.cuda.max_memory_allocated` is what gpu-check weighs `dspark plan` against on a GPU; this
reads the same quantity on CPU (the bytes of distinct live storages, sampled after every op), so
the plan's memory model is tested in every CPU run. torch's own MemTracker cannot be used: its
module hooks refuse frozen parameters (the draft's embedding and lm_head).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class PeakMemory(TorchDispatchMode):
    """`with PeakMemory() as m: ...; m.peak` (bytes). `track(...)` counts tensors that already
    exist (parameters, optimizer state, the batch) for as long as they live."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = self.peak = 0

    def track(self, tensors: Iterable[torch.Tensor]) -> PeakMemory:
        for t in tensors:
            self._add(t)
        self._sample()
        return self

    def _add(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        ref = StorageWeakRef(st)
        if ref.cdata not in self._live and st.nbytes():
            self._live[ref.cdata] = (ref, st.nbytes())
            self.current += st.nbytes()

    def _prune(self) -> None:
        for key in [k for k, (ref, _) in self._live.items() if ref.expired()]:
            self.current -= self._live.pop(key)[1]

    def _sample(self) -> None:
        self._prune()
        self.peak = max(self.peak, self.current)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._prune()  # what Python freed since the last op is free before this one allocates
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t)
        # Sampled while this op's outputs and inputs are both alive: the allocator's moment.
        self.peak = max(self.peak, self.current)
        return out


def state_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer | None = None) -> list[torch.Tensor]:
    """The tensors a training step starts with: parameters, buffers, gradients, optimizer state."""
    out = [*model.parameters(), *model.buffers()]
    out += [p.grad for p in model.parameters() if p.grad is not None]
    if opt is not None:
        out += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return out
