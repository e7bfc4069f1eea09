"""`dspark train CONFIG [KEY=VALUE ...]`: the online pipeline on this machine.

One streamer process per verifier node (hosting the verifier backend) and
trainer_nodes x ranks_per_node trainer processes, over gloo on CPU (NCCL on GPUs), exactly
as inside a Slurm allocation.
"""

from __future__ import annotations

import argparse

from hpc.config.schema import DSparkConfig


def run(args: argparse.Namespace) -> int:
    from hpc.config import resolve

    overrides = list(args.overrides) + ([f"train.steps={args.steps}"] if args.steps else [])
    cfg = resolve(args.config, overrides, check_tracking=False, runs_here=True)
    return train_local(cfg)


def _localize(cfg: DSparkConfig) -> DSparkConfig:
    from hpc.config.target import localize

    return localize(cfg)


def train_local(cfg: DSparkConfig, parent_run_id: str | None = None) -> int:
    """Prepare the data, then run every rank of the online world as a local process."""
    import torch.multiprocessing as mp

    from hpc.config.validate import trainer_ranks
    from hpc.dist.rendezvous import new_secret
    from hpc.net import free_port
    from hpc.train.driver import rank_process
    from hpc.train.prepare import prepare_data

    if cfg.tracking.uri.startswith("http"):
        from hpc.track.server import is_healthy

        if not is_healthy(cfg.tracking.uri):
            # Training is not held hostage by the tracking server: metrics wait in a buffer.
            from hpc.config.secrets import redact_uri

            print(f"warning: tracking server {redact_uri(cfg.tracking.uri)} unreachable; metrics are buffered and "
                  "sent when it answers", flush=True)
    cfg = _localize(cfg)  # a hub id becomes its local snapshot, once, before any rank starts
    prep = prepare_data(cfg)
    print(f"data: {prep.stats.summary()}; draft vocab {cfg.draft.draft_vocab_size}"
          + (f" ({prep.filled} slots filled with unseen ids)" if prep.filled else ""), flush=True)
    T, V = trainer_ranks(cfg), cfg.cluster.verifier_nodes
    ctx = mp.get_context("spawn")
    port, secret = free_port(), new_secret()
    procs = [ctx.Process(target=rank_process, args=(r, cfg, T, V, "127.0.0.1", port, secret, parent_run_id, r),
                         name=f"rank{r}") for r in range(T + V)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    codes = [p.exitcode for p in procs]
    if any(codes):
        import sys

        from hpc.train.driver import exit_status, failure_line

        print(f"ranks exited with {codes} (trainers 0..{T - 1}, streamers {T}..{T + V - 1})", flush=True)
        print(f"error: {failure_line(codes, T, cfg.train.output_dir)}", file=sys.stderr, flush=True)
    return exit_status(max((c or 0 for c in codes), key=abs)) if any(codes) else 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="run online training on this machine (verifier + streamer + trainers)")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    p.add_argument("--steps", type=int, default=None, help="override train.steps")
    p.set_defaults(func=run)
