"""A streamer rank of an online world, one per verifier node: start the verifier inside the
stream (heartbeating while vLLM loads), push each sample's hidden states to the trainers
(`hpc.stream.streamer`), stop the verifier. Its rows are every V-th id of each epoch's seeded
order, minus what the trainers' ledger says is done.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from hpc.config.schema import DSparkConfig
from hpc.dist.planes import Planes
from hpc.dist.world import World
from hpc.stream.streamer import run_streamer
from hpc.train import preempt_clock
from hpc.train.epochs import epoch_sequence
from hpc.verifier.backend import capture_concurrency, make_capture
from hpc.verifier.gpu_budget import samples_in_flight, stream_dtype_name

EXIT_VERIFIER_FAILED = 4  # a streamer whose verifier died, hung or never started


def stream_dtype(cfg: DSparkConfig) -> torch.dtype:
    return getattr(torch, stream_dtype_name(cfg))  # the rule `dspark plan` sizes the stream by


def streamer_rows(rows: dict[int, tuple[list[int], list[int]]], w: World, seed: int, epochs: int):
    """Streamer v takes every V-th id of each epoch's seeded order, minus the ledger's (epoch, id) pairs."""
    v = w.rank - w.n_trainers

    def gen(ledger: list[list[int]], start_epoch: int):
        for epoch, i in epoch_sequence(rows, seed, ledger, start_epoch, epochs, v, w.n_streamers):
            yield epoch, i, *rows[i]
    return gen


def streamer_rank(cfg: DSparkConfig, w: World, rows, planes: Planes, device: torch.device, out: Path,
                  names: list[str] | None = None) -> int:
    """Start the verifier, stream, stop the verifier; non-zero if it failed. `names`: each
    trainer group's draft, when several share the stream."""
    closers = []

    def start_capture():
        capture, closer = make_capture(cfg, str(device), out)  # cuda:N: capture threads have no current device
        closers.append(closer)
        return capture
    try:
        stats = run_streamer(streamer_rows(rows, w, cfg.train.seed, epochs=1000), None, planes, stream_dtype(cfg),
                             cfg.stream.prefetch, cfg.stream.heartbeat_s, capture_concurrency(cfg),
                             start_capture=start_capture, in_flight=cfg.stream.in_flight,
                             total_in_flight=samples_in_flight(cfg, len(planes.trainers)), groups=w.trainer_groups,
                             names=names)
    finally:
        t_stop = time.time()
        for closer in closers:
            if closer is not None:
                closer.close()
        # every attempt's end; node 0 reads it when the end is a requeue (hpc.train.preempt_clock)
        preempt_clock.mark(out, preempt_clock.VERIFIER_STOP, time.time() - t_stop, rank=w.rank,
                           backend=str(getattr(cfg.verifier.backend, "value", cfg.verifier.backend)))
    print(f"streamer {w.rank}: sent {stats.sent} samples ({stats.bytes / 1e6:.1f} MB), "
          f"skipped {stats.failed} bad captures"
          + (f"; {len(stats.dropped)} of {w.groups} drafts dropped" if stats.dropped else ""), flush=True)
    if stats.fatal:
        print(f"error: streamer {w.rank} (verifier node {w.rank - w.n_trainers}): {stats.fatal}",
              file=sys.stderr, flush=True)
        return EXIT_VERIFIER_FAILED
    return 0
