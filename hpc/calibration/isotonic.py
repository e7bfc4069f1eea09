"""The isotonic map's fit: a weighted isotonic regression of an event on a confidence logit
(pool-adjacent-violators). The map it makes, and how it is read, is a format
(`hpc.formats.calibration`)."""

from __future__ import annotations

import torch

# Slots are pooled into at most this many runs of neighbouring logits before the pool-adjacent-
# violators pass, which then costs O(runs) in Python however many slots Kimi's rows give.
MAX_RUNS = 512


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
