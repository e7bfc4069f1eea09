"""Learning-rate schedule: linear warmup, then cosine (or linear, or constant) decay.

A pure function of the step, so resuming needs only the step count: no scheduler object to
serialise, and no way for a resumed run to drift from an uninterrupted one.
"""

from __future__ import annotations

import math


def lr_factor(step: int, warmup: int, total: int, kind: str = "cosine", min_ratio: float = 0.0) -> float:
    """Multiplier of the peak lr for the update made at `step` (0-based)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    progress = min(max(step - warmup, 0) / max(total - warmup, 1), 1.0)
    if kind == "linear":
        decay = 1.0 - progress
    else:
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * decay
