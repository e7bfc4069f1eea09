"""Entry point of one trainer rank in the 2-process gloo DDP test (spawned, so importable)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist


def main(rank: int, world: int, port: int, target_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # several ranks share 2 cores: no OpenMP oversubscription
    from hpc.dist.planes import init_planes

    # The trainers' groups as in an online world (DDP on the data plane, bookkeeping on gloo).
    planes = init_planes(rank, world, list(range(world)), "gloo", torch.device("cpu"), "127.0.0.1", port)
    try:
        from hpc.train.sources import local_micro_batches
        from tests.train.test_resume import make_trainer, rows

        trainer, verifier = make_trainer(target_dir, out_dir, init_seed=rank,  # DDP broadcasts rank 0's init
                                         group=planes.train_data, control_group=planes.train_control)
        batches = local_micro_batches(verifier, rows(), trainer.micro_batch_size, rank, world, seed=3)
        trainer.run(batches, max_steps=4)
        digest = float(sum(p.double().sum() for p in trainer.model.parameters()))
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(
            {"losses": trainer.state.losses, "digest": digest, "ledger": trainer.state.ledger}))
    finally:
        dist.destroy_process_group()
