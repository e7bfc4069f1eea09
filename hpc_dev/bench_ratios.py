"""`bench acceptance`'s table: DSpark's tau (mean acceptance length) at n over each rival's, with
the 95% bootstrap interval over prompts of `hpc.evaluate.ratios`, and the recipe's goals.
"""

from __future__ import annotations

import statistics

from hpc.config.shared_sweep import ABLATIONS
from hpc.errors import UserError
from hpc.evaluate.ratios import Interval, ratio_interval
from hpc.tables import text_table

# The drafts of `dspark submit --ablations`, trained here in process: the same heads removed.
VARIANTS: dict[str, list[str]] = {name: list(extra) for name, extra in ABLATIONS.items()}
PEER = "ngram"
NS = (3, 7)
GOALS = {"DFlash": 1.15, PEER: 1.3}  # DSpark tau@7 over each, from the DSpark report


# -- the table and its ratios ----------------------------------------------------------------------
def tau_table(results: dict) -> dict[str, dict[int, dict[str, float]]]:
    """{draft label: {n: {benchmark: tau}}} from the evaluation's {job name: [BenchResult]}."""
    table: dict[str, dict[int, dict[str, float]]] = {}
    for res in results.values():
        for r in res:
            if r.n and r.accept_len is not None:
                table.setdefault(r.label, {}).setdefault(r.n, {})[r.benchmark] = r.accept_len
    return table


def mean_tau(table: dict, label: str, n: int) -> float | None:
    vals = list(table.get(label, {}).get(n, {}).values())
    return statistics.mean(vals) if vals else None


def ratios(table: dict) -> dict[str, float | None]:
    """DSpark tau@7 over each rival's (the mean over benchmarks of each, then the ratio)."""
    ours = mean_tau(table, "DSpark", max(NS))
    out: dict[str, float | None] = {}
    for rival in (*[v for v in VARIANTS if v != "DSpark"], PEER):
        theirs = mean_tau(table, rival, max(NS))
        out[rival] = ours / theirs if ours is not None and theirs else None
    return out


def evaluated_ns(table: dict) -> list[int]:
    """The n's the table holds: NS, or --quick's largest alone."""
    return sorted({n for by_n in table.values() for n in by_n}) or list(NS)


def format_table(table: dict, benches: list[str], intervals: dict | None = None) -> str:
    labels = [*VARIANTS, PEER]
    cols = [(lab, n) for lab in labels for n in evaluated_ns(table)]
    cell = lambda v: f"{v:.2f}" if v is not None else "-"  # noqa: E731
    rows = [[b, *(cell(table.get(lab, {}).get(n, {}).get(b)) for lab, n in cols)] for b in benches]
    rows.append(["mean", *(cell(mean_tau(table, lab, n)) for lab, n in cols)])
    lines = ["tau (mean acceptance length: tokens per verify step)",
             *text_table(["benchmark", *(f"{lab} n={n}" for lab, n in cols)], rows, right=range(1, len(cols) + 1)), ""]
    for rival, r in ratios(table).items():
        goal = GOALS.get(rival)
        verdict = "" if goal is None or r is None else (f"  meets the goal (>= {goal})" if r >= goal
                                                        else f"  misses the goal (>= {goal})")
        iv = (intervals or {}).get(rival)
        said = iv.text() if iv is not None else f"{r:.3f}x" if r is not None else "-"
        lines.append(f"DSpark / {rival} at n={max(NS)}: {said}{verdict if r is not None else ''}")
    return "\n".join(lines)


def interval_lines(tables: list[dict], seeds: list[int]) -> tuple[list[str], dict[str, Interval | None]]:
    """Over several seeds: each rival's ratio per seed, their mean and its interval over prompts."""
    out, lines = {}, [f"over seeds {', '.join(map(str, seeds))} (the same prompts):"]
    for rival in (*[v for v in VARIANTS if v != "DSpark"], PEER):
        iv = out[rival] = ratio_interval(tables, "DSpark", rival, max(NS))
        per = ", ".join(f"{r:.3f}" for r in iv.per_seed) if iv is not None else "-"
        lines.append(f"  DSpark / {rival} at n={max(NS)}: per seed {per}; mean " + (iv.text() if iv else "-"))
    return lines, out


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--seeds {text!r}: give comma-separated integers, e.g. --seeds 0,1,2") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise UserError(f"--seeds {text!r}: give distinct seeds, e.g. --seeds 0,1,2")
    return seeds
