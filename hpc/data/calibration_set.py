"""`dspark calibration-set CONFIG OUT`: a sample of the serving distribution to calibrate on.

The confidence head is calibrated on rows training never saw (the calibrate stage). Rows held
out of the training data share its distribution, and a map fitted there can be off where the
draft serves: on the toy target it said 0.40 where the benchmarks accepted 0.33 at position 1.
This writes the benchmarks' own rows that no evaluation reads (those after each manifest's row
limit; for LiveCodeBench, evaluated in full, its problems from other contest dates), rendered
exactly as the evaluation renders them, as single-turn conversations in the training data's
shape. Point data.calibration_sources at the file: the regenerate stage answers them with the
target, and the calibrate stage fits on them. SPEED-Bench coding gives none (its other
categories are not coding); a sample of your own traffic can be added beside. The rows are
spare for the eval.rows the set is written with: evaluating more rows later would read some.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

from hpc.errors import UserError
from hpc.formats.benchmarks import known_benchmarks, load_manifest, spare_prompts
from hpc.fsio import write_text
from hpc.verifier.verifier_checks import resolve

DEFAULT_ROWS = 64  # per benchmark
SOURCE = "calibration:"  # + the benchmark's name: each row's `source`, which regeneration keeps


def calibration_conversations(eval_cfg, per_benchmark: int) -> tuple[list[dict], dict[str, int]]:
    """(rows, count per benchmark) in the open-perfectblend shape, one user turn each."""
    rows, counts = [], {}
    for name in eval_cfg.benchmarks:
        prompts = spare_prompts(name, eval_cfg, per_benchmark)
        counts[name] = len(prompts)
        rows += [{"id": f"calibration-{name}-{i}", "source": f"{SOURCE}{name}",
                  "conversations": [{"from": "human", "value": p}]} for i, p in enumerate(prompts)]
    return rows, counts


def decoded_tokens(row: dict, eval_cfg) -> int | None:
    """The max_tokens the evaluation decodes this calibration row's benchmark at (the `source`
    this module writes); None for a row of any other source (served traffic has its own)."""
    source = str(row.get("source", ""))
    code = _is_code(source.removeprefix(SOURCE)) if source.startswith(SOURCE) else None
    return None if code is None else int(eval_cfg.code_max_tokens if code else eval_cfg.max_tokens)


@functools.cache
def _is_code(name: str) -> bool | None:
    """Whether benchmark `name` decodes at eval.code_max_tokens; None when there is no such
    benchmark. Cached: a calibration set asks once per row."""
    return load_manifest(name).code if name in known_benchmarks() else None


def write_calibration_set(eval_cfg, out: str | Path, per_benchmark: int = DEFAULT_ROWS) -> tuple[dict[str, int], Path]:
    """Write the calibration set as JSONL, atomically; returns (rows per benchmark, the file)."""
    if per_benchmark < 1:
        raise UserError(f"--rows {per_benchmark}: give at least 1 row per benchmark (default {DEFAULT_ROWS})")
    rows, counts = calibration_conversations(eval_cfg, per_benchmark)
    if not rows:
        raise UserError(f"no benchmark of eval.benchmarks={list(eval_cfg.benchmarks)} has rows that evaluation "
                        "does not read; add one that has (gsm8k, math500, aime, humaneval, livecodebench), or "
                        "use a sample of your own traffic as data.calibration_sources")
    out = Path(out).resolve()
    write_text(out, "".join(json.dumps(r) + "\n" for r in rows))
    return counts, out


def run(args: argparse.Namespace) -> int:
    # The config may name OUT as a calibration source already: it need not exist before this writes it.
    cfg = resolve(args.config, [*args.overrides, "data.calibration_sources=[]"], check_tracking=False)
    counts, out = write_calibration_set(cfg.eval, args.out, args.rows)
    for name, n in counts.items():
        print(f"  {name}: {n} rows" + ("" if n else " (evaluated in full: none spare)"))
    print(f"wrote {sum(counts.values())} calibration rows to {out}; set "
          f"data.calibration_sources=[{{path: {out}}}] to calibrate on them")
    return 0


def register(sub) -> None:
    p = sub.add_parser("calibration-set", help="benchmark rows no evaluation reads, to calibrate the confidence on",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("out", help="the .jsonl to write")
    p.add_argument("overrides", nargs="*", help="KEY=VALUE config overrides")
    p.add_argument("--rows", type=int, default=DEFAULT_ROWS, help=f"rows per benchmark (default {DEFAULT_ROWS})")
    p.set_defaults(func=run)
