"""Where trainer samples come from when no streamer is involved: an in-process verifier over
tokenised rows, in a seeded order that a ledger can resume exactly."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import torch

from hpc.stream.sample import MicroBatch
from hpc.verifier.hf_backend import HFVerifier


def epoch_order(sample_ids: Sequence[int], seed: int, epoch: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 7919 + epoch)
    return [sample_ids[i] for i in torch.randperm(len(sample_ids), generator=g).tolist()]


def local_micro_batches(
    verifier: HFVerifier, rows: dict[int, tuple[list[int], list[int]]], micro_batch_size: int, rank: int, world: int,
    seed: int, ledger: Sequence[Sequence[int]] = (), epoch: int = 0, epochs: int = 1_000_000,
) -> Iterator[MicroBatch]:
    """Each micro-step takes the next world*mb samples of the epoch sequence; rank r captures its slice.

    (epoch, id) pairs already in the ledger are skipped, so a resumed run continues where the
    checkpoint was. A micro-step may straddle two epochs.
    """
    chunk = world * micro_batch_size
    sequence = epoch_sequence(rows, seed, ledger, epoch, epochs)
    while len(step := list(itertools.islice(sequence, chunk))) == chunk:
        mine = step[rank * micro_batch_size:(rank + 1) * micro_batch_size]
        yield MicroBatch([verifier.capture(i, *rows[i]) for _, i in mine], step)


def epoch_sequence(sample_ids, seed: int, ledger: Sequence[Sequence[int]], epoch: int, epochs: int,
                   part: int = 0, parts: int = 1) -> Iterator[tuple[int, int]]:
    """(epoch, id) from `epoch` on in each epoch's seeded order, every `parts`-th from `part`,
    minus the ledger's pairs."""
    done = {(int(e), int(i)) for e, i in ledger}
    for ep in range(epoch, epochs):
        for i in epoch_order(sorted(sample_ids), seed, ep)[part::parts]:
            if (ep, i) not in done:
                yield ep, i
