"""The survival: the figure vLLM's adaptive verification reads from the confidence head.

vLLM 0.33 (`v1/worker/gpu/spec_decode/adaptive_verification.py`) scores slot k of a request by
its survival, the product of the slot confidences 1..k, and admits slots by it as an absolute
probability that slots 1..k are all accepted. Each slot's map is fitted to the chance that slot
is accepted once every earlier one was; the survival is calibrated only if those errors do not
compound, so it is measured on its own: per k, over the held-out blocks that drafted k slots,
each weighed by how often decoding drafts a block at its anchor.

vLLM reads no side file: it serves sigmoid(W x + c) for every slot. The one map it can carry is
an affine one on the head's logit, sigmoid(a z + b), which folds exactly into the weights
(W' = a W, c' = a c + b). `fit_fold` fits that map to the survival, as the DSpark paper's
sequential temperature scaling does per position: a per-position map cannot be folded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hpc.calibration.fit import MIN_WEIGHT, HeldOutSlots, concat_slots, weighted_ece, weighted_ece_floor
from hpc.formats.calibration import Fold

# The ECE search judges a k only with this many (effective) blocks: fewer read noise, which a
# two-number map must not chase.
MIN_BLOCKS = 200.0


def survival_table(slots: HeldOutSlots, mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] per held-out block: the survival at k (product of slots 1..k's confidences), its
    event (1..k all accepted: 0/1 for greedy, the product of the 1 - TV for sampling), and its
    weight (the chance decoding drafts that block; 0 where the block did not draft slots 1..k)."""
    z_NK, drafted_NK, event_NK, weight_NK = survival_grid(slots, mode)
    conf_NK = torch.where(drafted_NK > 0, torch.sigmoid(z_NK), torch.ones_like(z_NK))
    return conf_NK.cumprod(1), event_NK, weight_NK


def survival_grid(slots: HeldOutSlots, mode: str) -> tuple[torch.Tensor, ...]:
    """[N, K] per held-out block, float64 on the CPU: each slot's logit (0 where not drafted),
    whether it was drafted, the survival's event and weight (as `survival_table` gives them)."""
    if slots.block is None:
        raise ValueError("these slots carry no block ids (held_out_slots records them)")
    b, k = slots.block.long().cpu(), slots.position.long().cpu() - 1
    n, width = int(b.max()) + 1, int(k.max()) + 1
    z = torch.zeros(n, width, dtype=torch.float64)
    event = torch.ones(n, width, dtype=torch.float64)
    drafted = torch.zeros(n, width, dtype=torch.float64)
    z[b, k] = slots.logit.double().cpu()
    event[b, k] = (slots.greedy if mode == "greedy" else slots.sampling).double().cpu()
    drafted[b, k] = 1.0
    visit = torch.zeros(n, dtype=torch.float64)
    first = k == 0
    visit[b[first]] = slots.reach[mode].double().cpu()[first]
    return z, drafted, event.cumprod(1), visit[:, None] * drafted.cumprod(1)


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


def _survival_log_loss(ab: torch.Tensor, z_NK, drafted_NK, event_NK, weight_NK) -> torch.Tensor:
    """The log loss of the survival under sigmoid(a z + b), summed over k with each k's blocks
    weighing 1 in all: every position counts alike, as the goal judges each alike."""
    log_surv = torch.cumsum(F.logsigmoid(ab[0] * z_NK + ab[1]) * drafted_NK, 1).clamp(max=-1e-12)
    log_miss = torch.log(-torch.expm1(log_surv))
    per_k = weight_NK / weight_NK.sum(0).clamp(min=1e-12)
    return -(per_k * (event_NK * log_surv + (1 - event_NK) * log_miss)).sum()


def fit_fold_map(slots: HeldOutSlots, mode: str) -> tuple[float, float]:
    """(a, b) for the served head, in two steps. First the survival's log loss at every k, a
    proper score whose optimum is found by gradient; then, as the DSpark paper's sequential
    temperature scaling does, the ECE itself: a search around that optimum for the map whose
    worst survival ECE over k is least. One map serves every slot, and the log loss traded
    k = 1 away for the deeper k (on the toy, 0.059 at k = 1 against 0.008-0.032 beyond)."""
    grid = survival_grid(slots, mode)
    a, b = _log_loss_map(grid)
    if not (math.isfinite(a) and math.isfinite(b) and a > 0):
        return a, b
    return _least_worst_ece(grid, a, b)


def _log_loss_map(grid: tuple[torch.Tensor, ...]) -> tuple[float, float]:
    ab = torch.tensor([1.0, 0.0], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([ab], lr=0.5, max_iter=200, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = _survival_log_loss(ab, *grid)
        loss.backward()
        return loss

    opt.step(closure)
    a, b = (float(x) for x in ab.detach())
    return a, b


def _survival_eces(grid: tuple[torch.Tensor, ...], a: float, b: float, bins: int = 10) -> torch.Tensor:
    """[K] the survival's weighted ECE at each k under sigmoid(a z + b), as `survival_ece` bins it."""
    z_NK, drafted_NK, event_NK, weight_NK = grid
    surv_NK = torch.where(drafted_NK > 0, torch.sigmoid(a * z_NK + b), torch.ones_like(z_NK)).cumprod(1)
    K = surv_NK.shape[1]
    idx_NK = (surv_NK * bins).long().clamp(max=bins - 1) + torch.arange(K) * bins  # one bin range per k
    w = torch.bincount(idx_NK.flatten(), weight_NK.flatten(), K * bins).view(K, bins)
    we = torch.bincount(idx_NK.flatten(), (weight_NK * event_NK).flatten(), K * bins).view(K, bins)
    wc = torch.bincount(idx_NK.flatten(), (weight_NK * surv_NK).flatten(), K * bins).view(K, bins)
    return (we - wc).abs().sum(1) / w.sum(1).clamp(min=1e-12)


def _least_worst_ece(grid: tuple[torch.Tensor, ...], a: float, b: float, rounds: int = 3,
                     steps: int = 13) -> tuple[float, float]:
    """A coarse-to-fine grid over (log a, b) around (a, b): the map whose largest survival ECE
    over the k with enough blocks to read one (MIN_BLOCKS) is least. Ties keep the centre."""
    weight_K = grid[3].sum(0)
    judged = weight_K >= MIN_BLOCKS
    if not bool(judged.any()):
        return a, b

    def worst(x: float, y: float) -> float:
        return float(_survival_eces(grid, x, y)[judged].max())

    best, score = (a, b), worst(a, b)
    span_a, span_b = 0.7, 1.5
    for _ in range(rounds):
        ca, cb = best
        for da in torch.linspace(-span_a, span_a, steps).tolist():
            for db in torch.linspace(-span_b, span_b, steps).tolist():
                x, y = ca * math.exp(da), cb + db
                if (s := worst(x, y)) < score - 1e-9:
                    best, score = (x, y), s
        span_a, span_b = span_a / 4, span_b / 4
    return best


def folded(slots: HeldOutSlots, a: float, b: float) -> HeldOutSlots:
    return HeldOutSlots(a * slots.logit + b, slots.greedy, slots.sampling, slots.position, slots.reach, slots.block)


def mean_survival_ece(survival: list[tuple[float, float, float]]) -> float:
    """The mean over the k that any block drafted of the survival's ECE."""
    eces = [e for e, w, _ in survival if w > 0]
    return sum(eces) / len(eces) if eces else float("nan")


@dataclass
class FoldFit:
    fold: Fold | None  # None: nothing folded (`why` says so)
    why: str
    # per k, cross-fitted as the calibrate stage's other figures: the served head's survival
    # (each half folded by the map fitted on the other), None with a single half
    survival: list[tuple[float, float, float]] | None


def fit_fold(slots: HeldOutSlots, halves: tuple[HeldOutSlots, HeldOutSlots] | None, mode: str,
             fitted_on: dict | None = None) -> FoldFit:
    """The affine map to fold into the served head, fitted on `slots`, or none: with too few
    blocks to fit two numbers, when the fit is not increasing in the raw logit, or when,
    cross-fitted on the two `halves`, it reads a worse mean survival ECE than the raw head."""
    _, _, _, weight_NK = survival_grid(slots, mode)
    blocks = float(weight_NK[:, 0].sum())
    if blocks < MIN_WEIGHT:
        return FoldFit(None, f"{blocks:.0f} {mode} blocks drafted (effective), under the {MIN_WEIGHT:.0f} a "
                             "two-number fit needs; the served head stays raw (give more calibration rows)", None)
    a, b = fit_fold_map(slots, mode)
    if not (math.isfinite(a) and math.isfinite(b) and a > 0):
        return FoldFit(None, f"the fitted map ({a:.3g}, {b:.3g}) does not increase with the head's logit, so the "
                             "head ranks slots backwards; the served head stays raw (retrain the head)", None)
    crossed = None
    if halves is not None:
        (a0, b0), (a1, b1) = fit_fold_map(halves[0], mode), fit_fold_map(halves[1], mode)
        crossed = survival_ece(concat_slots([folded(halves[0], a1, b1), folded(halves[1], a0, b0)]), mode,
                               floors=mode == "greedy")
        raw = mean_survival_ece(survival_ece(concat_slots(list(halves)), mode))
        if mean_survival_ece(crossed) > raw:
            return FoldFit(None, f"the fold, cross-fitted, read a mean survival ECE of {mean_survival_ece(crossed):.3f} "
                                 f"against the raw head's {raw:.3f}; the served head stays raw", None)
    fold = Fold(a, b, mode, {**(fitted_on or {}), "blocks": round(blocks, 1)})
    return FoldFit(fold, f"folded sigmoid({a:.4f} z {'+' if b >= 0 else '-'} {abs(b):.4f}) into the served head "
                         f"(fitted to the {mode} survival on {blocks:.0f} blocks)", crossed)
