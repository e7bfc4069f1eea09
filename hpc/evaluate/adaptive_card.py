"""The card's adaptive-verification table, read back from MLflow (no torch: `dspark compare`
runs on a login node). Metric keys are `{mode}_R{R}_{figure}`, as BatchStats.metrics writes."""

from __future__ import annotations

import re

from hpc.track.keys import DRAFT, PARENT_RUN_ID, STAGE, STAGE_EVAL_ADAPTIVE

FIGURES = ("accepted_per_verified", "generated_per_step", "modelled_tok_s")
_KEY = re.compile(r"^(?P<mode>adaptive|n\d+)_R(?P<R>\d+)_(?P<figure>\w+)$")


def fetch_adaptive(client, pipelines: list, labels: dict[str, str]) -> list[tuple[str, str, dict]]:
    """(pipeline label, draft, metrics) of every adaptive-verification run under `pipelines`."""
    out = []
    for p in pipelines:
        where = f"tags.`{PARENT_RUN_ID}` = '{p.info.run_id}' and tags.`{STAGE}` = '{STAGE_EVAL_ADAPTIVE}'"
        for run in client.search_runs([p.info.experiment_id], where, max_results=100):
            out.append((labels[p.info.run_id], run.data.tags.get(DRAFT, "draft"), dict(run.data.metrics)))
    return out


def table_rows(metrics: dict) -> dict[tuple[int, str], dict[str, float]]:
    rows: dict[tuple[int, str], dict[str, float]] = {}
    for key, value in metrics.items():
        if (m := _KEY.match(key)) and m["figure"] in FIGURES:
            rows.setdefault((int(m["R"]), m["mode"]), {})[m["figure"]] = value
    return rows


def adaptive_markdown(records: list[tuple[str, str, dict]]) -> str:
    """Per R, adaptive against each fixed n, all priced by the run's one cost table; and per R
    whether adaptive beat the best fixed n. Empty when no run did adaptive verification."""
    if not records:
        return ""
    lines = ["", "Adaptive verification (vLLM's rule on the reference engine; tok/s priced by one cost table):", "",
             "| pipeline | draft | R | mode | accepted/verified | tokens/step | tok/s (costed) |",
             "|---|---|---|---|---|---|---|"]
    verdicts = []
    for pipeline, draft, metrics in records:
        rows = table_rows(metrics)
        for (R, mode), f in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1] != "adaptive", kv[0][1])):
            lines.append(f"| {pipeline} | {draft} | {R} | {mode} | {f.get('accepted_per_verified', 0):.3f} | "
                         f"{f.get('generated_per_step', 0):.2f} | {f.get('modelled_tok_s', 0):.1f} |")
        for R in sorted({r for r, _ in rows}):
            fixed = {m: f.get("modelled_tok_s", 0.0) for (r, m), f in rows.items() if r == R and m != "adaptive"}
            ada = rows.get((R, "adaptive"), {}).get("modelled_tok_s")
            if fixed and ada is not None:
                best = max(fixed, key=lambda m: fixed[m])
                verdicts.append(f"{pipeline} R={R}: adaptive {ada / fixed[best]:.3f}x the best fixed ({best})")
    return "\n".join(lines + ([""] + verdicts if verdicts else []))
