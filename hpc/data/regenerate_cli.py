"""`dspark regenerate CONFIG [KEY=VALUE ...]`: on-policy assistant turns from the target, for
data.sources and, into a directory of their own, data.calibration_sources.

Talks to an existing OpenAI-compatible server (--server-url), or starts vLLM from the config's
verifier section (verifier.python / model / extra_args / env; port 0 = a free port) on
127.0.0.1 and stops it at the end. Re-running the same command resumes.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from hpc.config.target import localize
from hpc.data.regenerate import calibration_data, regenerate, regenerate_all, regenerated_dir, start_regen_server
from hpc.errors import UserError
from hpc.verifier.verifier_checks import resolve


def run(args: argparse.Namespace) -> int:
    # Before anything resolves or vLLM loads the target (minutes on a node).
    for flag, value, unset in (("--shard-size", args.shard_size, "1000"), ("--concurrency", args.concurrency,
                               "data.regen_concurrency"), ("--max-rows", args.max_rows, "every row")):
        if value is not None and value < 1:
            raise UserError(f"{flag} {value}: must be at least 1 (leave it out for {unset})")
    cfg = localize(resolve(args.config, args.overrides, check_tracking=False))
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    server = None
    url = args.server_url
    key = os.environ.get("VLLM_API_KEY")  # an existing server's key, under vLLM's own variable
    if url is None:
        log = Path(cfg.data.output_dir) / "logs" / "regenerate-vllm.log"
        print(f"starting vLLM for {cfg.verifier.model} (log: {log})", flush=True)
        server = start_regen_server(cfg.verifier, log_path=log)
        url, key = server.url, server.api_key
    try:
        # --max-rows samples the training rows; the calibration rows are few and needed whole.
        stats, cal_stats = regenerate_all(cfg.data, lambda data: regenerate(
            data, url, shard_size=args.shard_size, concurrency=args.concurrency or cfg.data.regen_concurrency,
            progress=progress, max_rows=args.max_rows if data is cfg.data else None,
            log=lambda line: print(line, flush=True), api_key=key))
    finally:
        if server is not None:
            server.stop()
    print(f"regenerate: {stats.summary()} -> {regenerated_dir(cfg.data)}", flush=True)
    cal = calibration_data(cfg.data)
    if cal is not None and cal_stats is not None:
        print(f"regenerate: calibration rows: {cal_stats.summary()} -> {regenerated_dir(cal)}", flush=True)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("regenerate", help="regenerate the assistant turns of data.sources with the target (vLLM)")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    p.add_argument("--server-url", default=None,
                   help="an OpenAI-compatible server serving the target (default: start vLLM from the config)")
    p.add_argument("--shard-size", type=int, default=1000, help="input rows per output shard (default 1000)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="requests in flight; vLLM batches them (default: data.regen_concurrency)")
    p.add_argument("--max-rows", type=int, default=None,
                   help="stop after this many input rows (a later run without it continues)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: when stderr is a terminal)")
    p.set_defaults(func=run)
