"""How far to trust the DSpark confidence head, and what it buys: the calibration report.

Input per benchmark: the verify steps the eval recorded, each `(confs, matches)` over the k
drafted positions (head confidence for position i; 1 if draft token i equalled the target's
greedy token there). A step accepts the leading run of 1s.

Two questions are answered from the same data:
- is the head calibrated? ECE and Brier score per position, pooled over benchmarks;
- what should drafting do? the fixed n, and the confidence threshold (stop before the first
  position whose cumulative confidence product falls below it, keeping at least one), that
  maximise `(1 + E[accepted]) / (1 + cost * E[drafted])`: tokens per verify step over the
  step's cost, where one drafted token costs `cost` of a verify step (eval.draft_token_cost).
Truncations are replayed on the recorded steps, so a step drafted with k < n counts as k.
"""

from __future__ import annotations

import math
from pathlib import Path

from hpc.errors import UserError

Step = tuple[list[float], list[int]]
THRESHOLDS = [round(0.05 * j, 2) for j in range(1, 20)]  # 0.05 .. 0.95


def _validate(steps_by_bench: dict[str, list[Step]], cost: float, bins: int) -> None:
    if not (math.isfinite(cost) and cost >= 0):
        raise UserError(f"calibration: draft_token_cost = {cost}; use a share of a verify step >= 0, e.g. 0.03")
    if bins < 1:
        raise UserError(f"calibration: bins = {bins}; use at least 1")
    for bench, steps in steps_by_bench.items():
        for j, (confs, matches) in enumerate(steps):
            if not confs or len(confs) != len(matches):
                raise UserError(f"calibration: {bench} step {j} has {len(confs)} confidences and "
                                f"{len(matches)} matches; record one of each per drafted position")
            if any(not (0.0 <= c <= 1.0) for c in confs) or any(m not in (0, 1) for m in matches):
                raise UserError(f"calibration: {bench} step {j}: confidences must lie in [0, 1] and matches be 0/1")
    if not any(steps_by_bench.values()):
        raise UserError("calibration: no verify steps recorded; run the eval with the confidence head enabled")


def _leading_ones(matches: list[int], kept: int) -> int:
    run = 0
    for m in matches[:kept]:
        if not m:
            break
        run += 1
    return run


def _kept_by_threshold(confs: list[float], threshold: float) -> int:
    prod, kept = 1.0, 0
    for c in confs:
        prod *= c
        if prod < threshold:
            break
        kept += 1
    return max(1, kept)


def _policy(steps: list[Step], kept: list[int], cost: float) -> dict:
    accepted = sum(_leading_ones(m, k) for (_, m), k in zip(steps, kept)) / len(steps)
    drafted = sum(kept) / len(steps)
    return {"expected_accepted": accepted, "mean_drafted": drafted,
            "objective": (1.0 + accepted) / (1.0 + cost * drafted)}


def _best(candidates: list[dict]) -> dict:
    # max() keeps the first of equal objectives: the smallest n, the lowest threshold.
    return max(candidates, key=lambda c: c["objective"])


def benchmark_report(steps: list[Step], cost: float) -> dict:
    if not steps:
        return {"steps": 0}
    k_max = max(len(c) for c, _ in steps)
    fixed = [{"n": n, **_policy(steps, [min(n, len(c)) for c, _ in steps], cost)} for n in range(1, k_max + 1)]
    thresholds = [{"threshold": t, **_policy(steps, [_kept_by_threshold(c, t) for c, _ in steps], cost)}
                  for t in THRESHOLDS]
    return {"steps": len(steps), "k_max": k_max, "full": fixed[-1], "best_n": _best(fixed),
            "best_threshold": _best(thresholds), "fixed_n": fixed, "thresholds": thresholds}


def position_report(steps: list[Step], position: int, bins: int) -> dict:
    """ECE (equal-width bins, count-weighted |accuracy - confidence|) and Brier at one position."""
    pairs = [(c[position - 1], m[position - 1]) for c, m in steps if len(c) >= position]
    table = [[0, 0.0, 0.0] for _ in range(bins)]  # count, sum conf, sum match
    for conf, match in pairs:
        b = table[min(int(conf * bins), bins - 1)]
        b[0], b[1], b[2] = b[0] + 1, b[1] + conf, b[2] + match
    n = len(pairs)
    out_bins = [{"lo": i / bins, "hi": (i + 1) / bins, "count": cnt,
                 "conf": s_conf / cnt if cnt else None, "acc": s_match / cnt if cnt else None}
                for i, (cnt, s_conf, s_match) in enumerate(table)]
    ece = sum(cnt / n * abs(s_match / cnt - s_conf / cnt) for cnt, s_conf, s_match in table if cnt) if n else None
    return {"position": position, "count": n,
            "ece": ece,
            "brier": sum((c - m) ** 2 for c, m in pairs) / n if n else None,
            "mean_conf": sum(c for c, _ in pairs) / n if n else None,
            "accuracy": sum(m for _, m in pairs) / n if n else None,
            "bins": out_bins}


def calibration_report(steps_by_bench: dict[str, list[Step]], cost: float = 0.03, bins: int = 10) -> dict:
    """The whole report as plain JSON-serialisable data (log it as an MLflow artifact)."""
    _validate(steps_by_bench, cost, bins)
    pooled = [s for steps in steps_by_bench.values() for s in steps]
    n_max = max(len(c) for c, _ in pooled)
    return {"cost": cost, "bins": bins, "n_max": n_max,
            "positions": [position_report(pooled, i, bins) for i in range(1, n_max + 1)],
            "benchmarks": {b: benchmark_report(steps, cost) for b, steps in steps_by_bench.items()}}


def _num(value: float | None, fmt: str = ".3f") -> str:
    return "-" if value is None else format(value, fmt)


def _choice(p: dict) -> str:
    return f"{_num(p['objective'])} / {_num(p['expected_accepted'], '.2f')} ({p['mean_drafted']:.1f} drafted)"


def format_report(report: dict) -> str:
    lines = [f"confidence head calibration ({report['bins']} bins; a drafted token costs "
             f"{report['cost']:g} of a verify step)", "",
             f"{'pos':>3}  {'drafted':>8}  {'ECE':>6}  {'Brier':>6}  {'conf':>6}  {'acc':>6}"]
    for p in report["positions"]:
        lines.append(f"{p['position']:>3}  {p['count']:>8}  {_num(p['ece']):>6}  {_num(p['brier']):>6}  "
                     f"{_num(p['mean_conf']):>6}  {_num(p['accuracy']):>6}")
    width = max([9, *(len(b) for b in report["benchmarks"])])
    lines += ["", "objective = (1 + E[accepted]) / (1 + cost * drafted); cells: objective / E[accepted]",
              f"{'benchmark':<{width}}  {'steps':>6}  {'full n':<32}  {'best n':<32}  best threshold"]
    for bench, b in report["benchmarks"].items():
        if not b["steps"]:
            lines.append(f"{bench:<{width}}  {0:>6}  {'-':<32}  {'-':<32}  -")
            continue
        full = f"n={b['full']['n']} {_choice(b['full'])}"
        best_n = f"n={b['best_n']['n']} {_choice(b['best_n'])}"
        best_t = f"t={b['best_threshold']['threshold']:.2f} {_choice(b['best_threshold'])}"
        lines.append(f"{bench:<{width}}  {b['steps']:>6}  {full:<32}  {best_n:<32}  {best_t}")
    return "\n".join(lines)


def calibration_png(report: dict, path: str | Path) -> Path:
    """A reliability diagram per drafted position: accuracy per confidence bin against the diagonal."""
    from hpc.track.plots import _figure, _save

    plt = _figure()
    positions = report["positions"]
    cols = min(4, len(positions))
    rows = math.ceil(len(positions) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.0 * rows), squeeze=False)
    for ax, p in zip(axes.flat, positions):
        filled = [b for b in p["bins"] if b["count"]]
        width = 1.0 / report["bins"]
        ax.bar([b["lo"] for b in filled], [b["acc"] for b in filled], width=width, align="edge",
               edgecolor="black", alpha=0.7, label="accuracy")
        ax.plot([0, 1], [0, 1], ls="--", color="gray", lw=1)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_title(f"position {p['position']}: ECE {_num(p['ece'])}, n={p['count']}", fontsize=9)
        ax.set_xlabel("confidence")
        ax.set_ylabel("accuracy")
    for ax in list(axes.flat)[len(positions):]:
        ax.axis("off")
    fig.tight_layout()
    out = _save(fig, Path(path))
    plt.close(fig)
    return out
