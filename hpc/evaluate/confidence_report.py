"""How far to trust the DSpark confidence head, and what it buys: the calibration report.

Input per benchmark: the verify steps the eval recorded, each `(confs, matches)` over the k
drafted positions (head confidence for position i; 1 if draft token i was accepted). A step
accepts the leading run of 1s. A position's confidence is scored only in the steps that reached
it (every earlier draft accepted): that is the event the head predicts.

Two questions are answered from the same data:
- is the head calibrated? ECE and Brier score per position, pooled over benchmarks; and the ECE
  of the survival at each k (the product of the confidences of slots 1..k) against "slots 1..k
  were all accepted", over the steps that drafted k slots. vLLM's adaptive verification admits
  slots by that product, read as a probability, so it is the figure serving depends on;
- what should drafting do? the fixed n, and the confidence threshold (stop before the first
  position whose cumulative confidence product falls below it, keeping at least one), that
  maximise `(1 + E[accepted]) / (1 + cost * E[drafted])`: tokens per verify step over the
  step's cost, where one drafted token costs `cost` of a verify step (eval.draft_token_cost).
Truncations are replayed on the recorded steps, so a step drafted with k < n counts as k.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

from hpc.errors import UserError
from hpc.tables import text_table
from hpc.track.plots import _figure, _save

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


def reached(steps: list[Step], position: int) -> list[tuple[float, int]]:
    """(confidence, accepted) at `position` in the steps that drafted it with every earlier
    draft accepted: a slot after a rejection was drafted (and cost its share) but never judged."""
    return [(c[position - 1], m[position - 1]) for c, m in steps if len(c) >= position and all(m[:position - 1])]


def position_report(steps: list[Step], position: int, bins: int) -> dict:
    """ECE (equal-width bins, count-weighted |accuracy - confidence|) and Brier at one position."""
    pairs = reached(steps, position)
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


def survival(steps: list[Step], k: int) -> list[tuple[float, int]]:
    """(product of the confidences of slots 1..k, were they all accepted) in each step that drafted k."""
    return [(math.prod(c[:k]), int(all(m[:k]))) for c, m in steps if len(c) >= k]


def survival_report(steps: list[Step], k: int, bins: int) -> dict:
    """`position_report`'s figures for the survival at k, with its ECE floor."""
    pairs = survival(steps, k)
    report = position_report([([s], [e]) for s, e in pairs], 1, bins)
    return {**report, "position": k, "ece_floor": ece_floor([s for s, _ in pairs], bins)}


def perfect_head_eces(confs: list[float], bins: int = 10, draws: int = 200, seed: int = 0) -> list[float]:
    """The ECEs a perfectly calibrated head shows on these confidences at this count: one per
    event vector drawn as Bernoulli(conf), sorted."""
    if not confs:
        return [0.0]
    rng = random.Random(seed)
    return sorted(position_report([([c], [1 if rng.random() < c else 0]) for c in confs], 1, bins)["ece"]
                  for _ in range(draws))


def ece_floor(confs: list[float], bins: int = 10, draws: int = 200, seed: int = 0) -> float:
    """The mean of `perfect_head_eces`. ECE is biased upwards on few slots (60 slots at
    confidence 0.3 read about 0.08 with no miscalibration at all), so an ECE near this floor is
    sampling noise, not a head that lies."""
    eces = perfect_head_eces(confs, bins, draws, seed)
    return sum(eces) / len(eces)


def calibration_report(steps_by_bench: dict[str, list[Step]], cost: float = 0.03, bins: int = 10) -> dict:
    """The whole report as plain JSON-serialisable data (log it as an MLflow artifact)."""
    _validate(steps_by_bench, cost, bins)
    pooled = [s for steps in steps_by_bench.values() for s in steps]
    n_max = max(len(c) for c, _ in pooled)
    return {"cost": cost, "bins": bins, "n_max": n_max,
            "positions": [{**position_report(pooled, i, bins),
                           "ece_floor": ece_floor([c for c, _ in reached(pooled, i)], bins)}
                          for i in range(1, n_max + 1)],
            "survival": [survival_report(pooled, k, bins) for k in range(1, n_max + 1)],
            "benchmarks": {b: benchmark_report(steps, cost) for b, steps in steps_by_bench.items()}}


def _num(value: float | None, fmt: str = ".3f") -> str:
    return "-" if value is None else format(value, fmt)


def _choice(p: dict) -> str:
    return f"{_num(p['objective'])} / {_num(p['expected_accepted'], '.2f')} ({p['mean_drafted']:.1f} drafted)"


def format_report(report: dict) -> str:
    lines = [f"confidence head calibration ({report['bins']} bins; a drafted token costs "
             f"{report['cost']:g} of a verify step)", ""]
    # "ECE floor": what a perfectly calibrated head would read at this count (ece_floor).
    # Survival: the product of slots 1..k's confidences against "1..k all accepted" (what vLLM's
    # adaptive verification reads); older reports have none.
    survival = {s["position"]: s for s in report.get("survival", [])}
    lines += text_table(["pos", "drafted", "ECE", "ECE floor", "Brier", "conf", "acc",
                         "survival ECE", "floor", "survival", "all accepted"], [
        [str(p["position"]), str(p["count"]),
         *(_num(p.get(k)) for k in ("ece", "ece_floor", "brier", "mean_conf", "accuracy")),
         *(_num(survival.get(p["position"], {}).get(k)) for k in ("ece", "ece_floor", "mean_conf", "accuracy"))]
        for p in report["positions"]], right=range(11))
    rows = []
    for bench, b in report["benchmarks"].items():
        if not b["steps"]:
            rows.append([bench, "0", "-", "-", "-"])
            continue
        full = f"n={b['full']['n']} {_choice(b['full'])}"
        best_n = f"n={b['best_n']['n']} {_choice(b['best_n'])}"
        best_t = f"t={b['best_threshold']['threshold']:.2f} {_choice(b['best_threshold'])}"
        rows.append([bench, str(b["steps"]), full, best_n, best_t])
    lines += ["", "objective = (1 + E[accepted]) / (1 + cost * drafted); cells: objective / E[accepted]"]
    lines += text_table(["benchmark", "steps", "full n", "best n", "best threshold"], rows, right={1})
    return "\n".join(lines)


def calibration_png(report: dict, path: str | Path) -> Path:
    """A reliability diagram per drafted position: accuracy per confidence bin against the
    diagonal (bars), and the survival's (the product of slots 1..k) as a line."""
    plt = _figure()
    positions = report["positions"]
    cols = min(4, len(positions))
    rows = math.ceil(len(positions) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.0 * rows), squeeze=False)
    survival = {s["position"]: s for s in report.get("survival", [])}
    for ax, p in zip(axes.flat, positions):
        filled = [b for b in p["bins"] if b["count"]]
        width = 1.0 / report["bins"]
        ax.bar([b["lo"] for b in filled], [b["acc"] for b in filled], width=width, align="edge",
               edgecolor="black", alpha=0.7, label="slot")
        s = survival.get(p["position"])
        title = f"position {p['position']}: ECE {_num(p['ece'])}, n={p['count']}"
        if s is not None:
            sb = [b for b in s["bins"] if b["count"]]
            ax.plot([b["conf"] for b in sb], [b["acc"] for b in sb], marker="o", color="tab:red", label="survival")
            title += f"\nsurvival ECE {_num(s['ece'])}, n={s['count']}"
            ax.legend(fontsize=7, loc="upper left")
        ax.plot([0, 1], [0, 1], ls="--", color="gray", lw=1)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("confidence")
        ax.set_ylabel("accuracy")
    for ax in list(axes.flat)[len(positions):]:
        ax.axis("off")
    fig.tight_layout()
    out = _save(fig, Path(path))
    plt.close(fig)
    return out
