"""The survival: the figure vLLM's adaptive verification reads from the confidence head.

vLLM 0.33 (`v1/worker/gpu/spec_decode/adaptive_verification.py`) scores slot k of a request by
its survival, the product of the slot confidences 1..k, and admits slots by it as an absolute
probability that slots 1..k are all accepted. Each slot's map is fitted to the chance that slot
is accepted once every earlier one was; the survival is calibrated only if those errors do not
compound, so it is measured on its own: per k, over the held-out blocks that drafted k slots,
each weighed by how often decoding drafts a block at its anchor.
"""

from __future__ import annotations

import torch

from hpc.model.calibrate import HeldOutSlots, weighted_ece, weighted_ece_floor


def survival_table(slots: HeldOutSlots, mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] per held-out block: the survival at k (product of slots 1..k's confidences), its
    event (1..k all accepted: 0/1 for greedy, the product of the 1 - TV for sampling), and its
    weight (the chance decoding drafts that block; 0 where the block did not draft slots 1..k)."""
    if slots.block is None:
        raise ValueError("these slots carry no block ids (held_out_slots records them)")
    b, k = slots.block.long().cpu(), slots.position.long().cpu() - 1
    n, width = int(b.max()) + 1, int(k.max()) + 1
    conf = torch.ones(n, width, dtype=torch.float64)
    event = torch.ones(n, width, dtype=torch.float64)
    drafted = torch.zeros(n, width, dtype=torch.float64)
    conf[b, k] = torch.sigmoid(slots.logit.double()).cpu()
    event[b, k] = (slots.greedy if mode == "greedy" else slots.sampling).double().cpu()
    drafted[b, k] = 1.0
    visit = torch.zeros(n, dtype=torch.float64)
    first = k == 0
    visit[b[first]] = slots.reach[mode].double().cpu()[first]
    return conf.cumprod(1), event.cumprod(1), visit[:, None] * drafted.cumprod(1)


def survival_ece(slots: HeldOutSlots, mode: str, floors: bool = False) -> list[tuple[float, float, float]]:
    """Per k: (ECE of the survival, effective block count, the ECE a perfectly calibrated
    survival reads at that count, when `floors`; else nan). nan ECE where no block drafted k."""
    surv_NK, event_NK, weight_NK = survival_table(slots, mode)
    out = []
    for k in range(surv_NK.shape[1]):
        w = weight_NK[:, k]
        total = float(w.sum())
        if total <= 0:
            out.append((float("nan"), 0.0, float("nan")))
            continue
        at = w > 0
        # Fewer draws on many blocks (Kimi's held-out rows): the floor is small and steady there.
        floor = (weighted_ece_floor(surv_NK[at, k], w[at], draws=max(10, min(200, 1_000_000 // int(at.sum()))))
                 if floors else float("nan"))
        out.append((weighted_ece(surv_NK[at, k], event_NK[at, k], w[at]), total, floor))
    return out
