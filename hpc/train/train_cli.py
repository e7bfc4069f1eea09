"""`dspark train CONFIG [KEY=VALUE ...]`: the online pipeline on this machine.

One streamer process per verifier node (hosting the verifier backend) and
trainer_nodes x ranks_per_node trainer processes, over gloo on CPU (NCCL on GPUs), exactly
as inside a Slurm allocation.
"""

from __future__ import annotations

import argparse
import sys

from hpc.config.schema import DSparkConfig
from hpc.config.secrets import redact_uri
from hpc.config.target import localize
from hpc.config.validate import trainer_ranks
from hpc.data.prepare import prepare_data
from hpc.dist.rendezvous import new_secret
from hpc.net import free_port
from hpc.track.server import is_healthy
from hpc.train.ranks import exit_status, failure_line, grace_s, spawn_ranks, supervise
from hpc.verifier.verifier_checks import resolve


def run(args: argparse.Namespace) -> int:
    overrides = list(args.overrides) + ([f"train.steps={args.steps}"] if args.steps else [])
    cfg = resolve(args.config, overrides, check_tracking=False, runs_here=True)
    return train_local(cfg)


def train_local(cfg: DSparkConfig, parent_run_id: str | None = None) -> int:
    """Prepare the data, then run every rank of the online world as a local process."""
    if cfg.tracking.uri.startswith("http") and not is_healthy(cfg.tracking.uri):
        # Training is not held hostage by the tracking server: metrics wait in a buffer.
        print(f"warning: tracking server {redact_uri(cfg.tracking.uri)} unreachable; metrics are buffered and "
              "sent when it answers", flush=True)
    cfg = localize(cfg)  # a hub id becomes its local snapshot, once, before any rank starts
    prep = prepare_data(cfg)
    print(f"data: {prep.stats.summary()}; draft vocab {cfg.draft.draft_vocab_size}"
          + (f" ({prep.filled} slots filled with unseen ids)" if prep.filled else ""), flush=True)
    T, V = trainer_ranks(cfg), cfg.cluster.verifier_nodes
    procs = spawn_ranks(cfg, list(range(T + V)), list(range(T + V)), T, V, "127.0.0.1", free_port(), new_secret(),
                        parent_run_id)
    code, own = supervise(procs, grace_s(cfg))
    if code:
        print(f"ranks exited with {own} (trainers 0..{T - 1}, streamers {T}..{T + V - 1}; None: stopped here)",
              flush=True)
        print(f"error: {failure_line(own, T, cfg.train.output_dir)}", file=sys.stderr, flush=True)
    return exit_status(code)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="run online training on this machine (verifier + streamer + trainers)")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    p.add_argument("--steps", type=int, default=None, help="override train.steps")
    p.set_defaults(func=run)
