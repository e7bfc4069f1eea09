"""The maps that turn the confidence head's raw logit into a chance of acceptance, as stored
beside an export and read by whoever reads the confidences. No fitting lives here (that is
`hpc.calibration.fit` and `hpc.calibration.fold`): the draft (`hpc.model`) loads and applies
these, and sits below the fits, which run it.

- `Calibration`: per decoding mode and drafted position, Platt's sigmoid(a z + b) or an
  isotonic map (`confidence_calibration.json`, which vLLM does not read).
- `Fold`: the one affine map vLLM can carry, folded into the exported head's weights.
- The isotonic map: a weighted isotonic regression of an event on a confidence logit, a
  monotone map with no shape. A Platt map bends the head's logit one way only. On the toy target
  the accepted fraction rose faster than any such map through the middle of position 4's range
  (0.30, 0.40, 0.60 accepted at 0.36, 0.45, 0.55 said), which left a cross-fitted ECE of 0.050
  on 3,755 slots whose floor is 0.012; the isotonic map read 0.014 there. It needs many slots:
  the calibration keeps it only where it predicts the other half of the rows better than the
  Platt map does.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hpc.errors import UserError
from hpc.fsio import write_text

FILE = "confidence_calibration.json"
MODES = ("greedy", "sampling")

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


@dataclass
class Calibration:
    """Per mode, one (a, b) per drafted position: p = sigmoid(a * logit + b)."""

    maps: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    fitted_on: int = 0  # held-out drafted slots that decoding reads (weight > 0)
    # Per mode, the positions that share the pooled map (too few slots, or their own map
    # predicted the other half of the rows worse): a record of the fit, not read by `apply`.
    pooled_at: dict[str, list[int]] = field(default_factory=dict)
    # Per mode and position, an isotonic map's knots (`hpc.calibration.maps`) that replace that
    # position's Platt map: kept where it predicted the other half of the rows better.
    isotonic: dict[str, dict[int, tuple[list[float], list[float]]]] = field(default_factory=dict)
    # sha256 of the exported confidence head these maps sit beside (`hpc.model.export.head_sha256`):
    # the maps read that head's raw logit, so beside another head they would be wrong, silently.
    head_sha256: str | None = None

    def apply(self, logit: torch.Tensor, mode: str, position: int) -> torch.Tensor:
        """`position` counts drafted slots from 1; beyond the fitted ones the last map holds."""
        maps = self.maps.get(mode)
        if not maps:
            return logit
        k = min(position, len(maps))
        knots = self.isotonic.get(mode, {}).get(k)
        if knots is not None:
            return isotonic_logit(logit, knots)
        a, b = maps[k - 1]
        return a * logit + b

    def save(self, export_dir: str | Path) -> Path:
        path = Path(export_dir) / FILE
        isotonic = {m: {str(k): [list(xs), list(ps)] for k, (xs, ps) in per.items()} for m, per in self.isotonic.items()}
        write_text(path, json.dumps({"maps": self.maps, "fitted_on": self.fitted_on, "pooled_at": self.pooled_at,
                                     "isotonic": isotonic, "head_sha256": self.head_sha256,
                                     "logit": "the raw head's: undo config.json's confidence_fold first"},
                                    indent=1) + "\n")
        return path

    @classmethod
    def load(cls, export_dir: str | Path) -> Calibration | None:
        path = Path(export_dir) / FILE
        if not path.is_file():
            return None
        try:
            d = json.loads(path.read_text())
            maps = {m: [(float(a), float(b)) for a, b in d["maps"][m]] for m in d["maps"] if m in MODES}
            isotonic = {m: {int(k): _knots(xs, ps) for k, (xs, ps) in per.items()}
                        for m, per in d.get("isotonic", {}).items() if m in MODES}  # older files have none
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise UserError(f"{path}: not a confidence calibration ({err}); delete it or re-run the calibration") from None
        sha = d.get("head_sha256")  # older files have none
        return cls(maps, int(d.get("fitted_on", 0)), {m: list(v) for m, v in d.get("pooled_at", {}).items()}, isotonic,
                   sha if isinstance(sha, str) else None)


def _knots(xs, ps) -> tuple[list[float], list[float]]:
    xs, ps = [float(x) for x in xs], [float(p) for p in ps]
    if (not xs or len(xs) != len(ps) or not all(math.isfinite(x) for x in xs) or xs != sorted(xs)
            or ps != sorted(ps) or not all(0.0 <= p <= 1.0 for p in ps)):
        raise ValueError("isotonic knots must be non-empty, paired, finite sorted logits and sorted chances in [0, 1]")
    return xs, ps


@dataclass(frozen=True)
class Fold:
    """sigmoid(a z + b) on the head's raw logit z, folded into the exported head's weights."""

    a: float
    b: float
    mode: str  # the decoding mode whose survival it was fitted to (greedy | sampling)
    fitted_on: dict = field(default_factory=dict, compare=False)  # what it was fitted from, for config.json

    def logit(self, z: torch.Tensor) -> torch.Tensor:
        return self.a * z + self.b

    def unfold(self, z: torch.Tensor) -> torch.Tensor:
        return (z - self.b) / self.a

    def record(self) -> dict:
        return {"mode": self.mode, "a": self.a, "b": self.b, "fitted_on": dict(self.fitted_on)}

    @classmethod
    def from_record(cls, d: dict) -> Fold:
        a, b = float(d["a"]), float(d["b"])
        if not (math.isfinite(a) and math.isfinite(b) and a > 0) or d.get("mode") not in ("greedy", "sampling"):
            raise ValueError(f"confidence_fold {d}: needs a finite a > 0, a finite b and a mode greedy|sampling")
        return cls(a, b, str(d["mode"]), dict(d.get("fitted_on", {})))
