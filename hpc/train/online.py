"""One online training world: trainer ranks [0, T) and one streamer per verifier node [T, T+V).

The same function runs every rank, on a laptop over gloo or on H200 nodes over NCCL: the
rank decides the role. The groups (control over gloo, data over the training backend, and the
trainers' own pair of them) are described in `hpc.dist.planes`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from hpc.config.schema import StreamConfig, TrainConfig
from hpc.dist.planes import Planes, init_planes, open_pairs
from hpc.errors import EXIT_REQUEUE
from hpc.model.args import DraftArgs
from hpc.model.dspark import DSparkDraft
from hpc.model.target_weights import load_target_tensors
from hpc.model.teacher import TEACHER_ROLES, VerifierHead, target_head
from hpc.stream.receiver import StreamReceiver, stream_micro_batches
from hpc.train.loop import RequeueRequested, Trainer
from hpc.train.prepare import prepared_hash
from hpc.train.sources import epoch_sequence

EXIT_PEER_DIED = 3  # a trainer whose streamer (or another trainer) is gone: checkpointed, resumable
EXIT_VERIFIER_FAILED = 4  # a streamer whose verifier died, hung or never started


@dataclass
class World:
    rank: int
    n_trainers: int
    n_streamers: int

    @property
    def size(self) -> int:
        return self.n_trainers + self.n_streamers

    @property
    def is_trainer(self) -> bool:
        return self.rank < self.n_trainers

    @property
    def trainers(self) -> list[int]:
        return list(range(self.n_trainers))

    @property
    def streamers(self) -> list[int]:
        return list(range(self.n_trainers, self.size))


def init_world(w: World, backend: str, device: torch.device, master_addr: str, port: int, secret: str,
               timeout_s: float = 600.0, data_timeout_s: float | None = None, sample_bytes: int = 1) -> Planes:
    """Every rank's groups, on both planes, and every streamer -> trainer pair opened (collective:
    every rank of the world calls it, before any DDP collective can run)."""
    planes = init_planes(w.rank, w.size, w.trainers, backend, torch.device(device), master_addr, port, secret,
                         timeout_s, data_timeout_s)
    # DDP's default bucket (25 MiB): the trainers' first all-reduce happens here, not in step 1.
    open_pairs(planes, sample_bytes, bucket_bytes=25 * 2**20 if backend == "nccl" else 0)
    return planes


def streamer_rows(rows: dict[int, tuple[list[int], list[int]]], w: World, seed: int, epochs: int):
    """Streamer v takes every V-th id of each epoch's seeded order, minus the ledger's (epoch, id) pairs."""
    v = w.rank - w.n_trainers

    def gen(ledger: list[list[int]], start_epoch: int):
        for epoch, i in epoch_sequence(rows, seed, ledger, start_epoch, epochs, v, w.n_streamers):
            yield epoch, i, *rows[i]
    return gen


def build_draft(args: DraftArgs, target_dir: str, vocab_file: str | Path, norm: bool,
                train_lm_head: bool = False) -> tuple[DSparkDraft, VerifierHead]:
    """The draft with the target's frozen embedding and lm_head rows, and the verifier head."""
    from hpc.verifier.target_files import text_config

    tensors = load_target_tensors(target_dir, ("embed_tokens", *TEACHER_ROLES))
    vocab = load_file(str(vocab_file))
    positions = text_config(target_dir).get("max_position_embeddings")
    model = DSparkDraft(replace(args, max_position_embeddings=int(positions)) if positions else args)
    model.d2t.copy_(vocab["d2t"])
    model.t2d.copy_(vocab["t2d"])
    model.embed_tokens.weight.data.copy_(tensors["embed_tokens"].float())
    # Start from what the verifier would say about the draft's own hidden state: far better
    # than random, and what speculators does.
    model.lm_head.weight.data.copy_(tensors["lm_head"].float()[vocab["t2d"]])
    model.lm_head.weight.requires_grad_(train_lm_head)
    head = target_head(target_dir, vocab["t2d"], pre_norm=norm, tensors=tensors)
    return model, head


def autocast_dtype(train_cfg: TrainConfig, device: torch.device) -> torch.dtype | None:
    """bf16 (or fp16) autocast over fp32 master weights on GPU; CPU runs stay fp32."""
    if device.type != "cuda" or train_cfg.dtype == "float32":
        return None
    return getattr(torch, train_cfg.dtype)


def run_trainer(w: World, planes: Planes, train_cfg: TrainConfig, stream_cfg: StreamConfig, model: DSparkDraft,
                head: VerifierHead, out_dir: str | Path, verifier_name: str | None, on_step: Callable | None = None,
                epoch_size: int | None = None, device: torch.device | str = "cpu",
                verifier_arch: list[str] | None = None) -> int:
    """Train on `device` from the stream until the data or the step budget ends; returns the exit code."""
    device = torch.device(device)
    export_cfg = model.args.to_config_json(verifier_name, list(verifier_arch or []), model.args.max_n)
    trainer = Trainer(train_cfg, model, head, export_cfg, out_dir, device=device,
                      autocast_dtype=autocast_dtype(train_cfg, device), group=planes.train_data,
                      control_group=planes.train_control, epoch_size=epoch_size)
    trainer.resume()
    trainer.state.data_hash = prepared_hash(out_dir)  # every checkpoint names the data it counts
    stopped = Path(out_dir) / STOPPED
    if w.rank == 0:
        stopped.unlink(missing_ok=True)  # a cause from an earlier run is not this run's
    names = {s: f"streamer rank {s} (verifier node {s - w.n_trainers})" for s in w.streamers}
    receiver = StreamReceiver(w.streamers, stream_cfg.buffer_per_trainer, planes, stream_cfg.peer_timeout_s, names,
                              held_per_step=train_cfg.grad_accumulation * trainer.micro_batch_size)
    receiver.start(trainer.state.ledger, trainer.state.epoch, share_ledger=w.rank == 0)

    def step_hook(step: int, metrics: dict) -> None:
        # What the stream looks like from here: samples waiting, and time spent waiting for them.
        metrics["stream_buffered"] = receiver.samples.qsize()
        metrics["data_wait_s"] = receiver.wait_s
        if on_step is not None:
            on_step(step, metrics)
    try:
        trainer.run(stream_micro_batches(receiver, trainer.micro_batch_size), on_step=step_hook)
    except RequeueRequested as why:
        receiver.close()
        print(f"trainer {w.rank}: {why}", file=sys.stderr, flush=True)
        if w.rank == 0:
            _record_stop(stopped, trainer, train_cfg.steps, str(why))
        return EXIT_REQUEUE
    receiver.close()  # the streamers stop feeding us before anything else happens
    # Whatever stopped the loop, the progress so far is saved before anyone exits.
    if trainer.state.step % train_cfg.checkpoint_interval and trainer.state.step != train_cfg.steps:
        trainer.checkpoint()
    failed = torch.tensor([1.0 if receiver.error else 0.0])
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=planes.train_control)
    if failed.item():
        msg = receiver.error or "another trainer rank lost its streamer"
        print(f"trainer {w.rank}: stopping at step {trainer.state.step}, checkpoint saved: {msg}",
              file=sys.stderr, flush=True)
        if w.rank == 0:
            _record_stop(stopped, trainer, train_cfg.steps, msg)
        return EXIT_PEER_DIED
    return 0


STOPPED = "stopped.json"  # why the last run ended early: read by the launcher's one-line summary


def _record_stop(path: Path, trainer: Trainer, steps: int, cause: str) -> None:
    from hpc.fsio import write_text
    from hpc.train.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(trainer.ckpt_dir)
    write_text(path, json.dumps({"step": trainer.state.step, "steps": steps, "cause": cause,
                                 "checkpoint": ckpt.name if ckpt else None}))


def stop_summary(out_dir: str | Path) -> str | None:
    """One line: where training stopped, why, and what a re-run does; None if it did not stop early."""
    path = Path(out_dir) / STOPPED
    try:
        s = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    resume = (f"checkpoint {s['checkpoint']} is saved and a re-run resumes from it" if s.get("checkpoint")
              else "no checkpoint yet, a re-run starts over")
    return f"training stopped at step {s['step']} of {s['steps']}: {s['cause']}; {resume}"
