"""Weighted isotonic regression of an event on a confidence logit: a monotone map with no shape.

A Platt map (sigmoid(a z + b)) bends the head's logit one way only. On the toy target the
accepted fraction rose faster than any such map through the middle of position 4's range
(0.30, 0.40, 0.60 accepted at 0.36, 0.45, 0.55 said), which left a cross-fitted ECE of 0.050
on 3,755 slots whose floor is 0.012; the isotonic map read 0.014 there. It needs many slots:
the calibration keeps it only where it predicts the other half of the rows better than the
Platt map does (`hpc.model.calibrate`).
"""

from __future__ import annotations

import torch

# Slots are pooled into at most this many runs of neighbouring logits before the pool-adjacent-
# violators pass, which then costs O(runs) in Python however many slots Kimi's rows give.
MAX_RUNS = 512
# The map's chances are kept inside [EPS, 1 - EPS] so that its logit stays finite.
EPS = 1e-4


def fit_isotonic(z: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> tuple[list[float], list[float]]:
    """Knots (logits, chances) of the weighted least-squares non-decreasing fit of y on z,
    read between knots by linear interpolation and held flat beyond them (`isotonic_chance`)."""
    z, y, w = z.double().cpu(), y.double().cpu(), w.double().cpu()
    keep = w > 0
    z, y, w = z[keep], y[keep], w[keep]
    if z.numel() == 0:
        raise ValueError("no slot with weight: nothing to fit")
    order = torch.argsort(z)
    z, y, w = z[order], y[order], w[order]
    # Slots of one logit (bf16 logits take a few hundred values) are one point of the fit: pool
    # them first, so that no logit reads two chances and runs are cut only between logits.
    zu, at = torch.unique_consecutive(z, return_inverse=True)
    sw = torch.zeros_like(zu).index_add_(0, at, w)
    swy = torch.zeros_like(zu).index_add_(0, at, w * y)
    # Runs of neighbouring logits: (sum w*y, sum w, sum w*z), the unit the violators pass merges.
    runs = [(float(a.sum()), float(b.sum()), float((b * c).sum()))
            for a, b, c in zip(swy.tensor_split(MAX_RUNS), sw.tensor_split(MAX_RUNS), zu.tensor_split(MAX_RUNS))
            if b.numel()]
    blocks: list[list[float]] = []
    for wy, sum_w, wz in runs:
        blocks.append([wy, sum_w, wz])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] >= blocks[-1][0] / blocks[-1][1]:
            last = blocks.pop()
            for i in range(3):
                blocks[-1][i] += last[i]
    # A block's mean logit lies between its first and last, so the knots rise; cummax keeps a
    # rounding of two neighbouring means from putting them one ulp out of order.
    xs = torch.tensor([b[2] / b[1] for b in blocks], dtype=torch.float64).cummax(0).values
    return xs.tolist(), [b[0] / b[1] for b in blocks]


def _chance64(z: torch.Tensor, knots: tuple[list[float], list[float]]) -> torch.Tensor:
    xs = torch.tensor(knots[0], dtype=torch.float64, device=z.device)
    ps = torch.tensor(knots[1], dtype=torch.float64, device=z.device)
    zd = z.double()
    if xs.numel() == 1:
        return torch.full_like(zd, float(ps[0])).clamp(EPS, 1 - EPS)
    hi = torch.searchsorted(xs, zd.contiguous()).clamp(1, xs.numel() - 1)
    x0, x1, p0, p1 = xs[hi - 1], xs[hi], ps[hi - 1], ps[hi]
    t = ((zd - x0) / (x1 - x0).clamp(min=1e-12)).clamp(0, 1)  # tied knots: either end
    return (p0 + t * (p1 - p0)).clamp(EPS, 1 - EPS)


def isotonic_chance(z: torch.Tensor, knots: tuple[list[float], list[float]]) -> torch.Tensor:
    """The fitted chance at each logit of `z` (any shape and device), within [EPS, 1 - EPS]."""
    return _chance64(z, knots).to(z.dtype)


def isotonic_logit(z: torch.Tensor, knots: tuple[list[float], list[float]]) -> torch.Tensor:
    # The logit is taken in float64 and cast once: in bf16, 1 - EPS rounds to 1 and its logit is inf.
    return torch.logit(_chance64(z, knots)).to(z.dtype)
