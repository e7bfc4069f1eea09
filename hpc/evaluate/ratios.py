"""A draft's tau (mean acceptance length) over another's, with a 95% bootstrap interval over prompts.

A ratio's spread comes from which prompts were asked: on 40 toy prompts, seeds 0, 1 and 2 read
DSpark/DFlash at tau@7 as 1.178, 1.163 and 1.116, and nothing said whether those differ. Each
replicate draws the prompts of every benchmark again with replacement (the same draw for both
drafts: they answered the same prompts, so the ratio is paired), recomputes each benchmark's
tau from its prompts' verify steps and accepted tokens, and the ratio of the benchmark means.
Over several seeds a replicate is the mean of the seeds' ratios under one draw of prompts: the
interval of the mean ratio, over prompts, for these seeds.

The card's equal-budget table (`hpc.evaluate.equal_budget`) and `dspark-dev bench acceptance` read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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
