"""The equal-budget ratios with their uncertainty: DSpark's tau (mean acceptance length) at n over
each rival's, and a 95% bootstrap interval over prompts.

A ratio's spread comes from which prompts were asked: on 40 toy prompts, seeds 0, 1 and 2 read
DSpark/DFlash at tau@7 as 1.178, 1.163 and 1.116, and nothing said whether those differ. Each
replicate draws the prompts of every benchmark again with replacement (the same draw for both
drafts: they answered the same prompts, so the ratio is paired), recomputes each benchmark's
tau from its prompts' verify steps and accepted tokens, and the ratio of the benchmark means.
Over several seeds a replicate is the mean of the seeds' ratios under one draw of prompts: the
interval of the mean ratio, over prompts, for these seeds.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np

from hpc.errors import UserError
from hpc.tables import text_table

DFLASH = ["draft.markov_rank=0", "draft.enable_confidence_head=false", "draft.sample_from_anchor=false",
          "draft.confidence_head_with_markov=false"]
MARKOV_ONLY = ["draft.enable_confidence_head=false", "draft.confidence_head_with_markov=false"]
VARIANTS: dict[str, list[str]] = {"DSpark": [], "DFlash": DFLASH, "Markov-only": MARKOV_ONLY}
PEER = "ngram"
NS = (3, 7)
GOALS = {"DFlash": 1.15, PEER: 1.3}  # DSpark tau@7 over each, from the DSpark report
REPS = 2000  # bootstrap replicates: the 2.5th and 97.5th percentiles settle to ~0.005 by then
LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    ratio: float  # the mean over seeds of each seed's ratio on every prompt
    lo: float
    hi: float
    prompts: int  # per seed
    per_seed: tuple[float, ...]

    def text(self) -> str:
        return f"{self.ratio:.3f}x (95% CI {self.lo:.3f}-{self.hi:.3f}, bootstrap over {self.prompts} prompts)"


def prompt_table(results: dict) -> dict[str, dict[int, dict[str, np.ndarray]]]:
    """{draft label: {n: {benchmark: [[verify steps, accepted], ...] per prompt}}} from an
    evaluation's {job name: [BenchResult]}; benchmarks without per-prompt counts are left out."""
    table: dict[str, dict[int, dict[str, np.ndarray]]] = {}
    for res in results.values():
        for r in res:
            if r.n and r.per_prompt:
                table.setdefault(r.label, {}).setdefault(r.n, {})[r.benchmark] = np.asarray(r.per_prompt, float)
    return table


def _mean_tau(by_bench: dict[str, np.ndarray], draws: dict[str, np.ndarray] | None) -> np.ndarray:
    """Mean over benchmarks of tau = 1 + accepted / verify steps, per replicate (or once)."""
    taus = []
    for bench, counts in by_bench.items():
        rows = counts[draws[bench]] if draws is not None else counts[None]  # [reps, prompts, 2]
        steps, accepted = rows[..., 0].sum(-1), rows[..., 1].sum(-1)
        taus.append(1.0 + np.divide(accepted, steps, out=np.zeros_like(accepted), where=steps > 0))
    return np.mean(taus, axis=0)


def ratio_interval(tables: list[dict], ours: str, rival: str, n: int, reps: int = REPS,
                   seed: int = 0) -> Interval | None:
    """`ours` over `rival` at `n` across the seeds' prompt tables; None when a seed lacks either
    draft's per-prompt counts or they answered different prompts."""
    pairs = []
    for t in tables:
        a, b = t.get(ours, {}).get(n), t.get(rival, {}).get(n)
        if not a or not b or set(a) != set(b) or any(len(a[k]) != len(b[k]) for k in a):
            return None
        pairs.append((a, b))
    benches = sorted(pairs[0][0])
    if any(sorted(a) != benches or any(len(a[k]) != len(pairs[0][0][k]) for k in benches) for a, _ in pairs):
        return None  # the seeds' prompts must be the same ones for one draw to serve them all
    rng = np.random.default_rng(seed)
    draws = {k: rng.integers(0, len(pairs[0][0][k]), size=(reps, len(pairs[0][0][k]))) for k in benches}
    per_seed = [float(_mean_tau(a, None)[0] / _mean_tau(b, None)[0]) for a, b in pairs]
    boot = np.mean([_mean_tau(a, draws) / _mean_tau(b, draws) for a, b in pairs], axis=0)
    lo, hi = np.quantile(boot, [(1 - LEVEL) / 2, 1 - (1 - LEVEL) / 2])
    return Interval(float(np.mean(per_seed)), float(lo), float(hi), sum(len(pairs[0][0][k]) for k in benches),
                    tuple(per_seed))


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
