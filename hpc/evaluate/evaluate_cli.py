"""`dspark evaluate CONFIG [KEY=VALUE ...] --draft PATH --n 3,7`: a draft's speculative decoding
on the configured benchmarks, at each n, against the target decoding alone.

What it prints, in order:
  - a progress bar per (draft, n) and benchmark (a requeued job says which it does not re-run);
  - for a draft with a confidence head, its calibration per draft position: ECE beside the floor
    a calibrated head would read, Brier, mean confidence against accuracy;
  - a line per MLflow run logged, and the registry's verdict (`registry: NAME vN ...`), or where
    the results are kept when the tracking server does not answer;
  - the card, as `dspark compare` prints it: a row per benchmark and a mean row, a column per
    draft and n: the speedup over the baseline, the mean acceptance length, tokens/s.
Files: eval.output_dir/<run>/ holds each benchmark's JSON and the plots (per-position acceptance,
calibration); each (draft, n) is an MLflow child run of the pipeline's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hpc.errors import UserError
from hpc.evaluate.record import upload_all
from hpc.evaluate.runner import _tracking, evaluate
from hpc.verifier.verifier_checks import resolve


def parse_ns(text: str) -> list[int]:
    try:
        ns = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError as err:
        raise UserError(f"--n {text!r}: give comma-separated integers, e.g. --n 3,7") from err
    if not ns:
        raise UserError("--n: give at least one n, e.g. --n 3,7")
    return ns


def run(args: argparse.Namespace) -> int:
    cfg = resolve(args.config, list(args.overrides), check_tracking=False)
    if args.upload:
        client = _tracking(cfg.tracking)
        if client is None:
            return 1
        ids = upload_all(client, Path(cfg.eval.output_dir), cfg)
        print(f"uploaded {len(ids)} run(s) from {cfg.eval.output_dir}")
        return 0
    ns = parse_ns(args.n) if args.n else list(cfg.eval.num_speculative_tokens)
    evaluate(cfg, args.draft, ns, force_baseline=args.force_baseline, parent_run_id=args.parent_run_id)
    return 0


def register(sub) -> None:
    p = sub.add_parser("evaluate", help="benchmark a draft at n=3/n=7 against the no-speculation baseline",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="KEY=VALUE config overrides")
    p.add_argument("--draft", help="our export (DSpark or DFlash); third-party drafts come from eval.compare")
    p.add_argument("--n", help="comma-separated num_speculative_tokens (default: eval.num_speculative_tokens)")
    p.add_argument("--force-baseline", action="store_true", help="measure the baseline even if one is cached")
    p.add_argument("--parent-run-id", help="the pipeline's MLflow parent run (set by `dspark submit`)")
    p.add_argument("--upload", action="store_true", help="send run directories kept on disk to MLflow")
    p.set_defaults(func=run)
