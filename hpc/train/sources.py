"""Where trainer samples come from when no streamer is involved: an in-process verifier over
tokenised rows, in a seeded order that a ledger can resume exactly."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from hpc.train.loop import MicroBatch
from hpc.verifier.hf_backend import HFVerifier


def epoch_order(sample_ids: Sequence[int], seed: int, epoch: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 7919 + epoch)
    return [sample_ids[i] for i in torch.randperm(len(sample_ids), generator=g).tolist()]


def local_micro_batches(
    verifier: HFVerifier, rows: dict[int, tuple[list[int], list[int]]], micro_batch_size: int, rank: int, world: int,
    seed: int, ledger: Sequence[int] = (), epoch: int = 0, epochs: int = 1_000_000,
) -> Iterator[MicroBatch]:
    """Each micro-step takes the next world*mb ids of the epoch order; rank r captures its slice.

    Ids already in the ledger are skipped, so a resumed run continues where the checkpoint was.
    """
    done = set(ledger)
    chunk = world * micro_batch_size
    for ep in range(epoch, epochs):
        order = [i for i in epoch_order(sorted(rows), seed, ep) if i not in done]
        done = set()
        for start in range(0, len(order) - chunk + 1, chunk):
            ids = order[start:start + chunk]
            mine = ids[rank * micro_batch_size:(rank + 1) * micro_batch_size]
            yield MicroBatch([verifier.capture(i, *rows[i]) for i in mine], ids, ep)
