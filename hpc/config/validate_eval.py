"""Login-node checks of the evaluation section: benchmarks, n, decoding and the drafts compared."""

from __future__ import annotations

from pathlib import Path

from hpc.config.checker import Checker
from hpc.config.schema import BENCHMARKS, DSparkConfig

SPEC_METHODS = ("dspark", "dflash", "eagle", "eagle3", "ngram", "draft_model", "mtp", "medusa")


def check_eval(c: Checker, cfg: DSparkConfig) -> None:
    e = cfg.eval
    if not e.benchmarks:
        c.fail("eval.benchmarks", [], f"need at least one of {', '.join(BENCHMARKS)}")
    for b in e.benchmarks:
        if b not in BENCHMARKS:
            c.fail("eval.benchmarks", b, f"unknown benchmark; choose from {', '.join(BENCHMARKS)}")
    if not e.num_speculative_tokens:
        c.fail("eval.num_speculative_tokens", [], "need at least one n, e.g. [3, 7]")
    for n in e.num_speculative_tokens:
        if n < 1:
            c.fail("eval.num_speculative_tokens", n, "every n must be >= 1")
    c.positive("eval.max_tokens", e.max_tokens)
    c.positive("eval.code_max_tokens", e.code_max_tokens)
    if e.rows is not None:
        c.positive("eval.rows", e.rows)
    c.device("eval.device", e.device)
    c.nonneg("eval.temperature", e.temperature)
    if e.temperature > 2.0:
        c.fail("eval.temperature", e.temperature, "sampling temperatures above 2 are noise; use 0 (greedy) to 2, e.g. 0.7")
    c.positive("eval.timing_min_pairs", e.timing_min_pairs)
    c.path("eval.data_dir", e.data_dir, "benchmark data directory")
    for name, path in e.datasets.items():
        if name not in BENCHMARKS:
            c.fail(f"eval.datasets.{name}", path, f"unknown benchmark; choose from {', '.join(BENCHMARKS)}")
        elif not Path(path).expanduser().is_file():
            c.fail(f"eval.datasets.{name}", path, f"no such file; point it at a local {name} JSONL or parquet file")
    if not 0 <= e.draft_token_cost < 1:
        c.fail("eval.draft_token_cost", e.draft_token_cost, "the share of a verify step one drafted token costs: "
               "use a value in [0, 1), e.g. 0.03")
    _check_adaptive(c, cfg)
    names = [d.name for d in e.compare]
    for i, d in enumerate(e.compare):
        if not d.name:
            c.fail(f"eval.compare[{i}].name", d.name, "give the draft a name for the table, e.g. eagle3")
        c.one_of(f"eval.compare[{i}].method", d.method, SPEC_METHODS)
        if not d.model and d.method != "ngram":
            c.fail(f"eval.compare[{i}].model", d.model, "needs the draft model path or hub id")
    if len(set(names)) != len(names):
        c.fail("eval.compare", names, "draft names must be unique")
    if e.label is not None and (not e.label.strip() or e.label in names or e.label.lower() == "baseline"):
        c.fail("eval.label", e.label, "the draft's column on the card: give it a name of its own (not empty, not "
               "'baseline', not an eval.compare name), or leave it unset for DSpark")


def _check_adaptive(c: Checker, cfg: DSparkConfig) -> None:
    e = cfg.eval
    if e.adaptive and not cfg.draft.enable_confidence_head:
        c.fail("eval.adaptive", True, "adaptive verification ranks drafts by the confidence head, and "
               "draft.enable_confidence_head is false; enable the head or set eval.adaptive=false")
    if e.adaptive and not e.adaptive_concurrency:
        c.fail("eval.adaptive_concurrency", [], "need at least one request count, e.g. [1, 8, 32]")
    for r in e.adaptive_concurrency:
        if r < 1:
            c.fail("eval.adaptive_concurrency", r, "every concurrency must be >= 1 request")
    given = {k: getattr(e.adaptive_cost, k) for k in ("verify_ms", "draft_ms")}
    if any(given.values()) and not all(given.values()):
        missing = next(k for k, v in given.items() if not v)
        c.fail(f"eval.adaptive_cost.{missing}", [], "give both curves, or neither (then they are measured)")
    for key, curve in given.items():
        sizes = []
        for point in curve:
            if len(point) != 2 or point[0] < 1 or point[0] != int(point[0]) or not point[1] >= 0:
                c.fail(f"eval.adaptive_cost.{key}", list(point), "each point is [size, ms]: an integer size >= 1 "
                       "and a time >= 0, e.g. [64, 12.5]")
                break
            sizes.append(point[0])
        else:
            if sizes != sorted(set(sizes)):
                c.fail(f"eval.adaptive_cost.{key}", sizes, "sizes must increase, each once")
