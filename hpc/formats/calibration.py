"""The maps that turn the confidence head's raw logit into a chance of acceptance, as stored
beside an export and read by whoever reads the confidences. No fitting lives here (that is
`hpc.calibration`: fit, fold, isotonic): the draft (`hpc.model`) loads and applies these, and
sits below the fits, which run it. torch is imported where a map is applied, not at import.

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
from typing import TYPE_CHECKING

from hpc.errors import UserError
from hpc.fsio import write_text

if TYPE_CHECKING:
    import torch

FILE = "confidence_calibration.json"
MODES = ("greedy", "sampling")

# The map's chances are kept inside [EPS, 1 - EPS] so that its logit stays finite.
EPS = 1e-4


def _chance64(z: torch.Tensor, knots: tuple[list[float], list[float]]) -> torch.Tensor:
    import torch  # a map applied: the draft's process has torch already

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
    import torch  # a map applied: the draft's process has torch already

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
    # Per mode and position, an isotonic map's knots (`isotonic_chance`) that replace that
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
