"""`dspark train CONFIG [KEY=VALUE ...]`: the online pipeline on this machine.

One streamer process per verifier node (hosting the verifier backend) and
trainer_nodes x ranks_per_node trainer processes, over gloo on CPU (NCCL on GPUs), exactly
as inside a Slurm allocation.

`--share-verifier` trains every variant of the config's sweep from that one verifier: a group of
trainer processes per variant, each draft in `train.output_dir`/v<i>, every sample captured once.
`--ablations` trains DSpark, DFlash and Markov-only that way (submit.ablations). One draft's failure
(a rank killed, a NaN loss) is its own: the others finish and export, each failed draft gets one
line, and the command exits with EXIT_DRAFT_FAILED.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hpc.config import ConfigError, sweep_overrides
from hpc.config.schema import DSparkConfig
from hpc.config.secrets import redact_uri
from hpc.config.shared_sweep import ONE_VARIANT, share_problems, shares_verifier
from hpc.config.target import localize
from hpc.config.validate import trainer_ranks
from hpc.data.prepare import prepare_data
from hpc.dist.rendezvous import new_secret
from hpc.errors import EXIT_DRAFT_FAILED, UserError
from hpc.net import free_port
from hpc.track.pipeline import experiment_id
from hpc.track.server import is_healthy
from hpc.train.ranks import (
    exit_status,
    failed_drafts,
    failure_line,
    grace_s,
    record_draft_failure,
    spawn_ranks,
    supervise,
)
from hpc.verifier.verifier_checks import resolve


def run(args: argparse.Namespace) -> int:
    overrides = (list(args.overrides) + ([f"train.steps={args.steps}"] if args.steps else [])
                 + (["submit.ablations=true"] if args.ablations else []))
    cfg = resolve(args.config, overrides, check_tracking=False, runs_here=True)
    variants = sweep_variants(cfg)
    share = args.share_verifier or shares_verifier(cfg)
    if len(variants) > 1 and not share:
        raise UserError(f"sweep: {len(variants)} variants, and dspark train runs one config; pass --share-verifier "
                        "to train them all here from one verifier, or `dspark submit` for an allocation each")
    if not share:
        return train_local(cfg)
    if not cfg.submit.ablations and (problems := share_problems(dict(cfg.sweep), len(variants))):
        raise ConfigError(problems)
    base = Path(cfg.train.output_dir)
    return train_local(cfg, variants=[
        resolve(args.config, [*overrides, *extra, f"train.output_dir={base / f'v{i}'}", *ONE_VARIANT],
                check_tracking=False, runs_here=True) for i, extra in enumerate(variants)])


def sweep_variants(cfg: DSparkConfig) -> list[list[str]]:
    from omegaconf import OmegaConf  # as the config's loaders: only where a sweep is expanded

    return sweep_overrides(OmegaConf.structured(cfg))


def train_local(cfg: DSparkConfig, parent_run_id: str | None = None,
                variants: list[DSparkConfig] | None = None) -> int:
    """Prepare the data, then run every rank of the online world as a local process; with
    `variants`, one group of trainers per variant, all fed by the one verifier."""
    if cfg.tracking.uri.startswith("http") and not is_healthy(cfg.tracking.uri):
        # Training is not held hostage by the tracking server: metrics wait in a buffer.
        print(f"warning: tracking server {redact_uri(cfg.tracking.uri)} unreachable; metrics are buffered and "
              "sent when it answers", flush=True)
    # a hub id becomes its local snapshot, once, before any rank starts
    drafts = [localize(v) for v in variants] if variants else [localize(cfg)]
    for i, draft in enumerate(drafts):
        prep = prepare_data(draft)
        who = f"v{i} ({draft.train.output_dir}): " if variants else ""
        print(f"data: {who}{prep.stats.summary()}; draft vocab {draft.draft.draft_vocab_size}"
              + (f" ({prep.filled} slots filled with unseen ids)" if prep.filled else ""), flush=True)
    first = drafts[0]
    T, V = trainer_ranks(first) * len(drafts), first.cluster.verifier_nodes
    if first.tracking.uri.startswith("sqlite:"):
        # A new database's tables take MLflow's migrations seconds to create. In rank 0 they
        # would delay its ledger to the streamer, which sends nothing until it has every group's,
        # so the other trainers could call the streamer dead (stream.peer_timeout_s). With several
        # drafts, each draft's rank 0 would also create them at once (a race that fails all but one).
        from mlflow.tracking import MlflowClient  # mlflow: loaded only on this path

        experiment_id(MlflowClient(first.tracking.uri), first.tracking.experiment)
    if variants:
        print(f"one verifier, {len(drafts)} drafts: trainers {T // len(drafts)} per draft, ranks 0..{T - 1}", flush=True)
    procs = spawn_ranks(first, list(range(T + V)), list(range(T + V)), T, V, "127.0.0.1", free_port(), new_secret(),
                        parent_run_id, variants=drafts if variants else None)
    of = [r * len(drafts) // T for r in range(T)] + [-1] * V if variants else None  # each rank's draft
    code, own = supervise(procs, grace_s(first), of)
    if code:
        print(f"ranks exited with {own} (trainers 0..{T - 1}, streamers {T}..{T + V - 1}; None: stopped here)",
              flush=True)
        print(f"error: {failure_line(own, T, first.train.output_dir)}", file=sys.stderr, flush=True)
        return exit_status(code)
    lost = failed_drafts(own, of) if of else []
    for d in lost:  # each failed draft in one line, and in its directory; the others exported
        print(f"error: {record_draft_failure(drafts[d], d, own, of or [], T)}", file=sys.stderr, flush=True)
    if lost:
        print(f"{len(drafts) - len(lost)} of {len(drafts)} drafts finished and exported", file=sys.stderr, flush=True)
        return EXIT_DRAFT_FAILED
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="run online training on this machine (verifier + streamer + trainers)")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    p.add_argument("--steps", type=int, default=None, help="override train.steps")
    p.add_argument("--share-verifier", action="store_true",
                   help="train every variant of the config's sweep from one verifier (one group of trainers "
                        "each, in train.output_dir/v<i>); the sweep may not change what is captured")
    p.add_argument("--ablations", action="store_true",
                   help="train DSpark, DFlash and Markov-only from one verifier (submit.ablations): the "
                        "equal-budget ablations of the config's DSpark draft, in train.output_dir/v0..v2")
    p.set_defaults(func=run)
