"""Entry point of one trainer rank in the 2-process gloo DDP test (spawned, so importable)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist


def main(rank: int, world: int, port: int, target_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # several ranks share 2 cores: no OpenMP oversubscription
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from tests.train.test_resume import make_trainer, rows
        from hpc.train.sources import local_micro_batches

        trainer, verifier = make_trainer(target_dir, out_dir, init_seed=rank)  # DDP broadcasts rank 0's init
        batches = local_micro_batches(verifier, rows(), trainer.micro_batch_size, rank, world, seed=3)
        trainer.run(batches, max_steps=4)
        digest = float(sum(p.double().sum() for p in trainer.model.parameters()))
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(
            {"losses": trainer.state.losses, "digest": digest, "ledger": trainer.state.ledger}))
    finally:
        dist.destroy_process_group()
