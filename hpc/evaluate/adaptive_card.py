"""The card's adaptive-verification table, read back from MLflow (no torch: `dspark compare`
runs on a login node). Metric keys are `{mode}_R{R}_{figure}`, as BatchStats.metrics (the
reference engine, tok/s modelled by a cost table) and ServedStats.metrics (vLLM, tok/s
measured) write them; a run holds one kind or the other."""

from __future__ import annotations

import re

from hpc.track.keys import DRAFT, PARENT_RUN_ID, STAGE, STAGE_EVAL_ADAPTIVE

MODELLED = ("accepted_per_verified", "generated_per_step", "modelled_tok_s")
SERVED = ("accept_len", "accepted_per_drafted", "generated_per_step", "tok_s")
FIGURES = (*MODELLED, *SERVED)
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
    """Per R, adaptive against each fixed n; and per R whether adaptive beat the best fixed n.
    Reference-engine runs and vLLM runs get a table each: their tok/s are not the same figure.
    Empty when no run did adaptive verification."""
    modelled = [r for r in records if not _served(r[2])]
    served = [r for r in records if _served(r[2])]
    out: list[str] = []
    if modelled:
        out += _table(modelled, "vLLM's rule on the reference engine; tok/s priced by one cost table",
                      ("accepted/verified", "tokens/step", "tok/s (costed)"), MODELLED, "modelled_tok_s")
    if served:
        out += _table(served, "on vLLM with enable_adaptive_verification; tok/s measured, acc/drafted over the "
                      "drafts vLLM scheduled", ("accept len", "acc/drafted", "tokens/step", "tok/s"), SERVED, "tok_s")
    return "\n".join(out)


def _served(metrics: dict) -> bool:
    return any(k.endswith("_tok_s") and not k.endswith("_modelled_tok_s") for k in metrics)


def _table(records, title: str, heads: tuple[str, ...], figures: tuple[str, ...], speed: str) -> list[str]:
    lines = ["", f"Adaptive verification ({title}):", "",
             "| pipeline | draft | R | mode | " + " | ".join(heads) + " |", "|---" * (4 + len(heads)) + "|"]
    verdicts = []
    for pipeline, draft, metrics in records:
        rows = table_rows(metrics)
        for (R, mode), f in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1] != "adaptive", kv[0][1])):
            cells = [_cell(fig, f.get(fig, 0.0)) for fig in figures]
            lines.append(f"| {pipeline} | {draft} | {R} | {mode} | " + " | ".join(cells) + " |")
        for R in sorted({r for r, _ in rows}):
            fixed = {m: f.get(speed, 0.0) for (r, m), f in rows.items() if r == R and m != "adaptive"}
            ada = rows.get((R, "adaptive"), {}).get(speed)
            if fixed and ada is not None:
                best = max(fixed, key=lambda m: fixed[m])
                ratio = ada / fixed[best] if fixed[best] else float("nan")
                verdicts.append(f"{pipeline} R={R}: adaptive {ratio:.3f}x the best fixed ({best})")
    return lines + ([""] + verdicts if verdicts else [])


def _cell(figure: str, value: float) -> str:
    if figure.endswith("tok_s"):
        return f"{value:.1f}"
    return f"{value:.3f}" if figure.startswith("accepted") else f"{value:.2f}"
