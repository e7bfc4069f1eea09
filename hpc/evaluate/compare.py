"""The published card's table of drafts (and retrains): what `dspark compare` and the report print.

The table is built by a pure function over `EvalRecord`s so it can be tested without a server;
only `fetch_evals`/`find_pipelines` talk to MLflow, and they read exactly the tags and metrics
the eval runner logs (see `hpc.evaluate` for the contract). The command is `compare_cli`.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, field

from hpc.config.schema import BENCHMARKS
from hpc.errors import UserError
from hpc.evaluate.harness import NOISE_SLACK, implausible
from hpc.track.keys import (
    CONFIDENCE,
    DRAFT,
    ENGINE,
    MEAN,
    MEAN_ACCEPT_LEN,
    MEAN_SPEEDUP,
    METHOD,
    PARENT_RUN_ID,
    SPEC_N,
    STAGE,
    STAGE_EVAL,
    STAGE_PIPELINE,
    TEMPERATURE,
    metric,
)

OUR_DRAFT = "dspark"
MISSING = "-"
# A column on another engine than the baseline column's: its speedup is against a baseline the
# table does not show, and read beside the others it sets a torch loop's step savings against
# serving throughput, which measures the engines, not the draft.
ENGINES_DIFFER = "n/a (engines differ)"


@dataclass(frozen=True)
class EvalRecord:
    """One eval child run: one draft at one n, metrics keyed as logged (`gsm8k/tok_s`, ...)."""

    pipeline: str  # the label its columns carry when several pipelines are compared
    draft: str
    n: int
    metrics: dict[str, float] = field(default_factory=dict)
    method: str = ""
    engine: str = ""
    temperature: float = 0.0
    confidence: str = ""  # how its confidences were read (eval.confidence); "" on vLLM or without a head
    run_id: str = ""  # its MLflow run: the per-prompt counts of the equal-budget table are its artifact


@dataclass
class Table:
    columns: list[str]
    rows: list[list[str]]

    def row(self, first_cell: str) -> dict[str, str]:
        for r in self.rows:
            if r[0] == first_cell:
                return dict(zip(self.columns, r))
        raise KeyError(first_cell)


def _draft_title(draft: str) -> str:
    return "DSpark" if draft == OUR_DRAFT else draft


def draft_column(label: str, method: str) -> str:
    """Our --draft is one column; other drafts, our ablations among them, keep their names."""
    return OUR_DRAFT if method == "dspark" and label.lower() == OUR_DRAFT else label


def _benchmarks(evals: list[EvalRecord]) -> list[str]:
    seen = {k.split("/", 1)[0] for e in evals for k in e.metrics if "/" in k} - {MEAN}
    return [b for b in BENCHMARKS if b in seen] + sorted(seen - set(BENCHMARKS))


def _cell(tok_s: float | None, speedup: float | None, accept_len: float | None,
          lo: float | None = None, hi: float | None = None, engines_differ: bool = False) -> str:
    if tok_s is None and speedup is None and accept_len is None:
        return MISSING
    speed = ENGINES_DIFFER if engines_differ else MISSING
    if speedup is not None and not engines_differ:
        speed = f"{speedup:.2f}x" + ("!" if implausible(speedup, accept_len) else "")
        if lo is not None and hi is not None:
            speed += f" [{lo:.2f}-{hi:.2f}]"
    parts = [MISSING if tok_s is None else f"{tok_s:.1f}", speed,
             MISSING if accept_len is None else f"{accept_len:.2f}"]
    return " / ".join(parts)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _first(evals: list[EvalRecord], key: str) -> float | None:
    return next((e.metrics[key] for e in evals if key in e.metrics), None)


def card_table(evals: list[EvalRecord]) -> Table:
    """The card: one row per benchmark (card order) and a `mean` row; one column per draft and n.

    Columns: dspark first, then the other drafts by name, each at ascending n; with several
    pipelines, each pipeline's columns in turn, prefixed by its label. A later record for the
    same (pipeline, draft, n) replaces an earlier one, so pass them oldest first. `best` is the
    column with the highest speedup (first one on a tie). In the mean row, `rows` is the total
    and speedup/accept_len are the runner's `mean/*` metrics when logged. A column on another
    engine than the baseline column's (vLLM's, when any column ran on it) shows no speedup.
    """
    latest: dict[tuple[str, str, int, float], EvalRecord] = {}
    pipelines: list[str] = []
    for e in evals:
        latest[(e.pipeline, e.draft, e.n, e.temperature)] = e
        if e.pipeline not in pipelines:
            pipelines.append(e.pipeline)
    prefix = len(pipelines) > 1
    keys = sorted(latest, key=lambda k: (pipelines.index(k[0]), k[1] != OUR_DRAFT, k[1], k[3], k[2]))
    titles = [f"{p + ' ' if prefix else ''}{_draft_title(d)} n={n}{f' T={t:g}' if t > 0 else ''}"
              for p, d, n, t in keys]
    records = [latest[k] for k in keys]
    ordered = list(latest.values())  # pipeline order is the caller's, so baseline comes from the first
    # A serving engine's baseline first: the reference loop's tok/s are not serving throughput.
    ordered.sort(key=lambda e: (e.engine not in ("", "vllm"), pipelines.index(e.pipeline)))
    engines = [rec.engine or "vllm" for rec in records]
    mixed = len(set(engines)) > 1
    base_engine = (ordered[0].engine or "vllm") if ordered else "vllm"
    on_base = [e for e in ordered if (e.engine or "vllm") == base_engine]  # the baseline column's engine only
    off = [engine != base_engine for engine in engines]  # no speedup against another engine's baseline

    rows: list[list[str]] = []
    totals: dict[str, list[float]] = {}
    per_record: list[dict[str, list[float]]] = [{"tok_s": [], "speedup": [], "accept_len": []} for _ in records]
    for bench in _benchmarks(evals):
        n_rows, baseline = _first(ordered, metric(bench, "rows")), _first(on_base, metric(bench, "baseline_tok_s"))
        if n_rows is not None:
            totals.setdefault("rows", []).append(n_rows)
        if baseline is not None:
            totals.setdefault("baseline", []).append(baseline)
        cells, scores = [], []
        for rec, acc, cross in zip(records, per_record, off):
            vals = {m: rec.metrics.get(metric(bench, m)) for m in ("tok_s", "speedup", "accept_len", "speedup_lo",
                                                                   "speedup_hi")}
            for m, v in vals.items():
                if v is not None:
                    acc.setdefault(m, []).append(v)
            cells.append(_cell(vals["tok_s"], vals["speedup"], vals["accept_len"], vals["speedup_lo"],
                               vals["speedup_hi"], cross))
            scores.append(vals)
        rows.append([bench, MISSING if n_rows is None else str(int(n_rows)),
                     MISSING if baseline is None else f"{baseline:.1f}", *cells, _best(titles, scores, mixed)])

    mean_cells, mean_scores = [], []
    for rec, acc, cross in zip(records, per_record, off):
        vals = {"speedup": rec.metrics.get(MEAN_SPEEDUP, _mean(acc["speedup"])),
                "accept_len": rec.metrics.get(MEAN_ACCEPT_LEN, _mean(acc["accept_len"])),
                "speedup_lo": _mean(acc.get("speedup_lo", [])), "speedup_hi": _mean(acc.get("speedup_hi", []))}
        mean_cells.append(_cell(_mean(acc["tok_s"]), vals["speedup"], vals["accept_len"], vals["speedup_lo"],
                                vals["speedup_hi"], cross))
        mean_scores.append(vals)
    total_rows, mean_base = totals.get("rows"), _mean(totals.get("baseline", []))
    rows.append(["mean", MISSING if not total_rows else str(int(sum(total_rows))),
                 MISSING if mean_base is None else f"{mean_base:.1f}", *mean_cells, _best(titles, mean_scores, mixed)])
    base_title = f"baseline tok/s ({base_engine})" if mixed else "baseline tok/s"
    return Table(["benchmark", "rows", base_title, *titles, "best"], rows)


def _best(titles: list[str], scores: list[dict], mixed_engines: bool = False) -> str:
    """The fastest column when timing can tell; else the longest acceptance, marked "(by tau)".

    Timing cannot tell when the fastest column's speedup is implausible (above tau x 1.05: such
    columns never win), when its spread (paired timing) overlaps another column's, or when the
    columns' speedups come from different engines (a torch loop's against vLLM's).
    max() keeps the first of equal scores, so a tie goes to the leftmost column.
    """
    timed = [] if mixed_engines else [i for i, s in enumerate(scores) if s.get("speedup") is not None]
    plausible = [i for i in timed if not implausible(scores[i]["speedup"], scores[i].get("accept_len"))]
    if plausible and len(plausible) == len(timed):
        top = max(plausible, key=lambda i: scores[i]["speedup"])
        lo = scores[top].get("speedup_lo")
        rivals = [scores[i].get("speedup_hi") for i in plausible if i != top]
        if lo is None or all(hi is not None and lo > hi for hi in rivals):
            return titles[top]
    taus = [i for i, s in enumerate(scores) if s.get("accept_len") is not None]
    if taus:
        return f"{titles[max(taus, key=lambda i: scores[i]['accept_len'])]} (by tau)"
    return titles[max(plausible, key=lambda i: scores[i]["speedup"])] if plausible else MISSING


# Kept hand-written (issue 13): six lines make the exact GitHub pipe table; rich's MARKDOWN box wraps to a console width.
def to_markdown(table: Table) -> str:
    widths = [max(len(c), *(len(r[i]) for r in table.rows)) for i, c in enumerate(table.columns)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(table.columns), rule, *(line(r) for r in table.rows)])


def to_csv(table: Table) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(table.columns)
    writer.writerows(table.rows)
    return buf.getvalue().rstrip("\n")


# -- MLflow side ---------------------------------------------------------------------------------
def _search_all(client, experiment_id: str, filter_string: str, order_by: list[str]) -> list:
    runs, token = [], None
    while True:
        page = client.search_runs([experiment_id], filter_string, max_results=1000, order_by=order_by,
                                  page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def find_pipelines(client, experiment, selectors: list[str]) -> list:
    """The pipeline runs asked for (id, run name or id prefix; a name means its latest run),
    or the latest pipeline of the experiment when none is asked for."""
    where = f"experiment '{experiment.name}'"
    runs = _search_all(client, experiment.experiment_id, f"tags.`{STAGE}` = '{STAGE_PIPELINE}'",
                       ["attributes.start_time DESC"])
    if not runs:
        raise UserError(f"no pipeline run (tag {STAGE}={STAGE_PIPELINE}) in {where}; run a pipeline or pass --experiment")
    if not selectors:
        return [runs[0]]
    chosen = []
    for sel in selectors:
        hit = [r for r in runs if r.info.run_id == sel] or [r for r in runs if r.info.run_name == sel][:1]
        if not hit and len(sel) >= 6:
            hit = [r for r in runs if r.info.run_id.startswith(sel)]
            if len(hit) > 1:
                raise UserError(f"--pipeline {sel!r} matches {len(hit)} run ids in {where}; give more characters")
        if not hit:
            raise UserError(f"--pipeline {sel!r}: no pipeline run with that id or run name in {where}")
        chosen.append(hit[0])
    return chosen


def pipeline_labels(runs: list) -> dict[str, str]:
    """Run name per pipeline; the short id where names collide (retrains of one config share it)."""
    names = [r.info.run_name or r.info.run_id[:8] for r in runs]
    return {r.info.run_id: (name if names.count(name) == 1 else r.info.run_id[:8]) for r, name in zip(runs, names)}


def fetch_evals(client, pipelines: list) -> list[EvalRecord]:
    labels = pipeline_labels(pipelines)
    out: list[EvalRecord] = []
    for p in pipelines:
        where = f"tags.`{PARENT_RUN_ID}` = '{p.info.run_id}' and tags.`{STAGE}` = '{STAGE_EVAL}'"
        for run in _search_all(client, p.info.experiment_id, where, ["attributes.start_time ASC"]):
            tags = run.data.tags
            try:
                n = int(tags.get(SPEC_N, ""))
            except ValueError:
                continue  # not an eval this table can place; the runner always sets n
            draft = draft_column(tags.get(DRAFT, OUR_DRAFT), tags.get(METHOD, ""))
            out.append(EvalRecord(labels[p.info.run_id], draft, n,
                                  dict(run.data.metrics), tags.get(METHOD, ""),
                                  tags.get(ENGINE, ""), float(tags.get(TEMPERATURE) or 0), tags.get(CONFIDENCE, ""),
                                  run.info.run_id))
    return out


def card_markdown(table: Table, evals: list[EvalRecord]) -> str:
    """The table as people read it: markdown, what its marks mean, and which engine made which column."""
    return to_markdown(table) + legend(table) + tau_verdict(evals) + engine_note(evals) + confidence_note(evals)


def _mean_tau(rec: EvalRecord) -> float | None:
    logged = rec.metrics.get(MEAN_ACCEPT_LEN)
    if logged is not None:
        return logged
    return _mean([v for k, v in rec.metrics.items() if k.endswith("/accept_len") and k != MEAN_ACCEPT_LEN])


def tau_verdict(evals: list[EvalRecord]) -> str:
    """Whether our draft beats each other draft on tau (greedy, at the largest n both ran), said
    plainly: a speedup can be timing noise, acceptance length cannot."""
    greedy = {(e.pipeline, e.draft, e.n): e for e in evals if e.temperature == 0}
    lines = []
    for (pipe, draft, n), ours in sorted(greedy.items()):
        if draft != OUR_DRAFT or n != max(k[2] for k in greedy if k[0] == pipe and k[1] == OUR_DRAFT):
            continue
        mine = _mean_tau(ours)
        for (p2, rival, n2), theirs in sorted(greedy.items()):
            other = _mean_tau(theirs)
            if p2 != pipe or n2 != n or rival == OUR_DRAFT or mine is None or other is None:
                continue
            verdict = "beats" if mine > other else "does NOT beat"
            lines.append(f"tau at n={n}: {_draft_title(draft)} {mine:.2f} vs {_draft_title(rival)} {other:.2f}: "
                         f"{_draft_title(draft)} {verdict} {_draft_title(rival)} on tau")
    return "\n\n" + "\n".join(lines) if lines else ""


def legend(table: Table) -> str:
    """What the marks in the table mean, for the marks it holds."""
    text = "\n".join("|".join(r) for r in table.rows)
    lines = []
    if "[" in text:
        lines.append("speedup [lo-hi]: median and quartiles of paired baseline/draft request ratios")
    if "x!" in text:
        lines.append(f"x!: a speedup above tau x {NOISE_SLACK:g} is impossible: timing noise, never chosen as best")
    if "(by tau)" in text:
        lines.append("best (by tau): timing could not separate the columns, so the longest acceptance is named")
    if ENGINES_DIFFER in text:
        lines.append(f"{ENGINES_DIFFER}: the column ran on another engine than the baseline column; a speedup "
                     "read across engines measures the engines, not the draft: compare tau")
    return "\n\n" + "\n".join(lines) if lines else ""


def engine_note(evals: list[EvalRecord]) -> str:
    """Which engine produced which column: vLLM numbers and reference-engine numbers differ in kind."""
    by_engine: dict[str, set[str]] = {}
    for e in evals:
        temp = f" T={e.temperature:g}" if e.temperature > 0 else ""
        by_engine.setdefault(e.engine or "vllm", set()).add(f"{_draft_title(e.draft)} n={e.n}{temp}")
    if set(by_engine) <= {"vllm"}:
        return ""
    parts = [f"{engine}: {', '.join(sorted(cols))}" for engine, cols in sorted(by_engine.items())]
    return "\n\nengines: " + "; ".join(parts) + " (reference = exact spec decoding in a torch loop, for drafts " \
        "this vLLM build cannot decode: not a serving engine, its tok/s show step savings, not serving throughput)"


CONFIDENCE_READS = {
    "served": "the exported head alone, its fold in the weights, as vLLM computes it",
    "side_file": "confidence_calibration.json's per-position maps, which vLLM does not read",
}


def confidence_note(evals: list[EvalRecord]) -> str:
    """How the reference engine read each column's confidence head (its calibration figures)."""
    by: dict[str, set[str]] = {}
    for e in evals:
        if e.confidence:
            by.setdefault(e.confidence, set()).add(f"{_draft_title(e.draft)} n={e.n}")
    parts = [f"{mode} ({CONFIDENCE_READS.get(mode, mode)}): {', '.join(sorted(cols))}" for mode, cols in sorted(by.items())]
    return "\n\nconfidence: " + "; ".join(parts) if parts else ""
