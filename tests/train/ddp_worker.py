"""Entry point of one trainer rank in the 2-process gloo DDP test (spawned, so importable)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

SECRET = "ddp-test-" + "0" * 56  # every rank of a test world holds the same


def main(rank: int, world: int, port: int, target_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # several ranks share 2 cores: no OpenMP oversubscription
    from hpc.dist.planes import init_planes

    # The trainers' groups as in an online world (DDP on the data plane, bookkeeping on gloo).
    planes = init_planes(rank, world, list(range(world)), "gloo", torch.device("cpu"), "127.0.0.1", port, SECRET)
    try:
        from hpc.train.epochs import local_micro_batches
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


def empty_row_main(rank: int, world: int, port: int, out_dir: str) -> None:
    """Two ranks, and rank 1's row has no anchor (a three-token reply at its end): both must
    finish their steps, with the same all-reduced metrics and the same weights."""
    torch.set_num_threads(1)
    from hpc.dist.planes import init_planes
    from hpc.stream.sample import Capture, MicroBatch
    from tests.model.test_dspark import H, V

    planes = init_planes(rank, world, list(range(world)), "gloo", torch.device("cpu"), "127.0.0.1", port, SECRET,
                         timeout_s=60)  # a regression fails in a minute instead of hanging the suite
    try:
        trainer = _tiny_trainer(planes, out_dir)
        g = torch.Generator().manual_seed(rank)
        T = 40
        mask = torch.zeros(T, dtype=torch.long)
        if rank == 0:
            mask[5:] = 1
        else:
            mask[-3:] = 1
        cap = Capture(rank, torch.randint(0, V - 1, (T,), generator=g), mask, torch.randn(T, 3, H, generator=g),
                      torch.randn(T, H, generator=g))
        steps = [trainer.step([MicroBatch([cap], [(0, 2 * s), (0, 2 * s + 1)])]) for s in range(2)]
        digest = float(sum(p.double().sum() for p in trainer.model.parameters()))
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"steps": steps, "digest": digest}))
    finally:
        dist.destroy_process_group()


def resume_choice_main(rank: int, world: int, port: int, out_dir: str) -> None:
    """Two ranks, one checkpoint directory with steps 2 and 4; rank 1's view of the shared
    filesystem is stale and shows only step 2. Both must resume step 4, rank 0's choice."""
    torch.set_num_threads(1)
    from hpc.dist.planes import init_planes
    from hpc.formats.checkpoint_layout import TrainState, list_checkpoints
    from hpc.train import trainer as loop

    planes = init_planes(rank, world, list(range(world)), "gloo", torch.device("cpu"), "127.0.0.1", port, SECRET,
                         timeout_s=60)
    try:
        trainer = _tiny_trainer(planes, out_dir)
        for step in (2, 4):
            trainer.state.step = step
            trainer.checkpoint()
        if rank == 1:
            stale = list_checkpoints(trainer.ckpt_dir)[0]
            loop.latest_checkpoint = lambda root, say=None: stale  # type: ignore[assignment]
        trainer.state = TrainState()
        assert trainer.resume()
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"step": trainer.state.step}))
    finally:
        dist.destroy_process_group()


def _tiny_trainer(planes, out_dir: str):
    """A Trainer of the tiny test draft on the trainers' two groups: 2 samples per step, no checkpoints."""
    from hpc.config.schema import TrainConfig
    from hpc.model.teacher import VerifierHead
    from hpc.train.trainer import Trainer
    from tests.model.test_dspark import D, H, V, tiny_model

    model = tiny_model(seed=0)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.arange(D) + model.d2t] = True
    head = VerifierHead(torch.randn(V, H, generator=torch.Generator().manual_seed(0)), t2d)
    cfg = TrainConfig(device="cpu", dist_backend="gloo", global_batch_size=2, grad_accumulation=1,
                      warmup_steps=0, steps=10, checkpoint_interval=1000, output_dir=out_dir)
    return Trainer(cfg, model, head, {}, out_dir, group=planes.train_data, control_group=planes.train_control)


def short_stream_main(rank: int, world: int, port: int, out_dir: str) -> None:
    """Rank 1's stream ends after 2 batches, rank 0's has 5: both stop after step 2, agreed on the
    control plane, instead of rank 0 posting DDP's all-reduce for a step rank 1 never takes."""
    torch.set_num_threads(1)
    from hpc.dist.planes import init_planes
    from hpc.stream.sample import Capture, MicroBatch
    from tests.model.test_dspark import H, V

    planes = init_planes(rank, world, list(range(world)), "gloo", torch.device("cpu"), "127.0.0.1", port, SECRET,
                         timeout_s=60, data_timeout_s=20)  # a regression fails in seconds instead of hanging
    try:
        trainer = _tiny_trainer(planes, out_dir)
        g = torch.Generator().manual_seed(rank)

        def batches(n: int):
            for s in range(n):
                T = 40
                mask = torch.zeros(T, dtype=torch.long)
                mask[5:] = 1
                cap = Capture(s, torch.randint(0, V - 1, (T,), generator=g), mask, torch.randn(T, 3, H, generator=g),
                              torch.randn(T, H, generator=g))
                yield MicroBatch([cap], [(0, 2 * s + rank)])
        state = trainer.run(batches(5 if rank == 0 else 2))
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"step": state.step}))
    finally:
        dist.destroy_process_group()
