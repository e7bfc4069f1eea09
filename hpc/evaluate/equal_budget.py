"""The card's equal-budget table: the ablations of one pipeline (`dspark submit --ablations`).

DSpark, DFlash and Markov-only trained from one capture stream, at one budget, seed and data
order, so what separates them is the heads each keeps. The table gives each draft's tau (mean
acceptance length over the benchmarks) at every n they all ran, and DSpark's tau over each
ablation's with its 95% bootstrap interval over prompts (`hpc.evaluate.ratios`): the
`dspark-dev bench acceptance` table, at cluster scale. The per-prompt counts come from each eval
run's results.json; without them (an older run) the ratio prints without its interval.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from hpc.config.shared_sweep import ABLATIONS
from hpc.evaluate.compare import OUR_DRAFT, EvalRecord, Table, draft_column, to_markdown
from hpc.evaluate.ratios import ratio_interval
from hpc.track.keys import MEAN_ACCEPT_LEN

PerPrompt = dict[str, np.ndarray]  # {benchmark: [[verify steps, accepted], ...] per prompt}
OURS = "DSpark"


def _column(name: str) -> str:
    return draft_column(name, "dspark")  # our DSpark draft is the card's "dspark" column


def equal_budget_markdown(evals: list[EvalRecord], per_prompt: Callable[[EvalRecord], PerPrompt | None]) -> str:
    """The section, or "" when no pipeline holds DSpark and one of its ablations at one n (greedy)."""
    names = {_column(name): name for name in ABLATIONS}
    out = []
    for pipe in dict.fromkeys(e.pipeline for e in evals):
        mine = {(e.draft, e.n): e for e in evals if e.pipeline == pipe and e.temperature == 0 and e.draft in names}
        rivals = [name for col, name in names.items() if col != OUR_DRAFT and any(d == col for d, _ in mine)]
        ns = sorted({n for d, n in mine if d == OUR_DRAFT and any((_column(r), n) in mine for r in rivals)})
        if not ns:
            continue
        drafts = [OURS, *rivals]
        rows = []
        for n in ns:
            taus = [mine.get((_column(d), n)) for d in drafts]
            cells = [f"{t.metrics[MEAN_ACCEPT_LEN]:.2f}" if t and MEAN_ACCEPT_LEN in t.metrics else "-" for t in taus]
            ours = mine[(OUR_DRAFT, n)]
            for rival in rivals:
                cells.append(_ratio(ours, mine.get((_column(rival), n)), n, per_prompt))
            rows.append([str(n), *cells])
        title = f"Equal budget{f' ({pipe})' if len(set(e.pipeline for e in evals)) > 1 else ''}"
        out.append(f"\n\n### {title}: one capture, one budget, the heads differ\n\n"
                   + to_markdown(Table(["n", *(f"{d} tau" for d in drafts), *(f"{OURS} / {r}" for r in rivals)], rows))
                   + "\n\nratio: DSpark's tau over the ablation's (the mean over benchmarks of each); [lo-hi]: 95% "
                     "bootstrap interval over prompts, the same draw for both drafts")
    return "".join(out)


def _ratio(ours: EvalRecord, theirs: EvalRecord | None, n: int,
           per_prompt: Callable[[EvalRecord], PerPrompt | None]) -> str:
    if theirs is None:
        return "-"
    a, b = ours.metrics.get(MEAN_ACCEPT_LEN), theirs.metrics.get(MEAN_ACCEPT_LEN)
    mine, other = per_prompt(ours), per_prompt(theirs)
    if mine and other:
        iv = ratio_interval([{OURS: {n: mine}, "rival": {n: other}}], OURS, "rival", n)
        if iv is not None:
            return f"{iv.ratio:.3f}x [{iv.lo:.3f}-{iv.hi:.3f}]"
    return f"{a / b:.3f}x (no per-prompt counts)" if a and b else "-"


def mlflow_per_prompt(client) -> Callable[[EvalRecord], PerPrompt | None]:
    """Each eval run's per-prompt counts, from its results.json artifact (None when it has none)."""
    def load(rec: EvalRecord) -> PerPrompt | None:
        if not rec.run_id:
            return None
        with tempfile.TemporaryDirectory() as tmp:
            try:
                path = client.download_artifacts(rec.run_id, "results.json", tmp)
                results = json.loads(Path(path).read_text()).get("results", [])
            except Exception:  # noqa: BLE001 - an older run without it: the ratio prints without its interval
                return None
        out = {r["benchmark"]: np.asarray(r["per_prompt"], float) for r in results
               if r.get("n") == rec.n and r.get("per_prompt")}
        return out or None

    return load
