"""A trainer rank of an online world: train on what the streamers send until the step budget
or the data ends, checkpoint whatever stopped it, and say why in one line (`stopped.json`).

Rank 0 also reports (`hpc.train.train_report`). Exit codes: 0, EXIT_REQUEUE (checkpointed on a stop
signal), EXIT_PEER_DIED (a streamer or another trainer is gone; checkpointed, resumable),
EXIT_DRAFT_FAILED (this draft's own loss went NaN: when drafts share the stream, the others go on).
"""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from hpc.config.schema import DSparkConfig, StreamConfig
from hpc.data.prepare import prepared_hash
from hpc.dist.planes import Planes
from hpc.dist.world import World
from hpc.errors import EXIT_DRAFT_FAILED, EXIT_REQUEUE
from hpc.formats import draft_failure
from hpc.formats.checkpoint_layout import latest_checkpoint
from hpc.fsio import write_text
from hpc.stream.receiver import StreamReceiver, stream_micro_batches
from hpc.train import preempt_clock
from hpc.train.train_report import TrainReport
from hpc.train.trainer import NonFiniteLoss, RequeueRequested, Trainer

EXIT_PEER_DIED = 3  # a trainer whose streamer (or another trainer) is gone: checkpointed, resumable
STOPPED = "stopped.json"  # why the last run ended early: read by the launcher's one-line summary


def trainer_rank(cfg: DSparkConfig, w: World, planes: Planes, vocab_file: str | Path, epoch_size: int,
                 device: torch.device, out: Path, parent_run_id: str | None = None) -> int:
    """Build the trainer the config describes, train from the stream, report on rank 0."""
    # The training loop turns USR2/TERM into a checkpoint and a requeue. Outside it (setup, and the
    # export after the last step) a signal must not kill the rank: the default action would end
    # the node's task with 244 and fail a job whose training was complete.
    for sig in (signal.SIGUSR2, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    trainer = Trainer.from_config(cfg, out, vocab_file=vocab_file, device=device, planes=planes,
                                  epoch_size=epoch_size)
    report = None
    try:
        if w.group_rank == 0:
            report = TrainReport(cfg, out, parent_run_id)
        code = run_trainer(w, planes, trainer, cfg.stream, out, report.on_step if report is not None else None,
                           variant=(cfg.eval.label or f"v{w.group}") if w.groups > 1 else None)
        if report is not None:
            # A preempted run is KILLED (Slurm requeues it), a failed one FAILED: never left RUNNING.
            report.finish(export=code == 0,
                          status="FINISHED" if code == 0 else "KILLED" if code == EXIT_REQUEUE else "FAILED")
        return code
    except BaseException as err:
        # rank_process ends the process with os._exit: without this the run would stay RUNNING
        # and whatever the logger still buffers would be lost.
        if report is not None:
            report.end_on_error(err)
        raise


def run_trainer(w: World, planes: Planes, trainer: Trainer, stream_cfg: StreamConfig, out_dir: str | Path,
                on_step: Callable | None = None, variant: str | None = None) -> int:
    """Train from the stream until the data or the step budget ends; returns the exit code.
    `variant`: this draft's name when several share the stream (its failure line names it)."""
    train_cfg = trainer.cfg
    trainer.state.data_hash = prepared_hash(out_dir)  # every checkpoint names the data it counts
    stopped = Path(out_dir) / STOPPED
    if w.group_rank == 0:
        stopped.unlink(missing_ok=True)  # a cause from an earlier run is not this run's
        draft_failure.clear(out_dir)
    names = {s: f"streamer rank {s} (verifier node {s - w.n_trainers})" for s in w.streamers}
    receiver = StreamReceiver(w.streamers, stream_cfg.buffer_per_trainer, planes, stream_cfg.peer_timeout_s, names,
                              held_per_step=train_cfg.grad_accumulation * trainer.micro_batch_size)
    receiver.start(trainer.state.ledger, trainer.state.epoch, share_ledger=w.group_rank == 0)

    def step_hook(step: int, metrics: dict) -> None:
        # What the stream looks like from here: samples waiting, and time spent waiting for them.
        metrics["stream_buffered"] = receiver.samples.qsize()
        metrics["data_wait_s"] = receiver.wait_s
        if on_step is not None:
            on_step(step, metrics)
    try:
        trainer.run(stream_micro_batches(receiver, trainer.micro_batch_size), on_step=step_hook)
    except RequeueRequested as why:
        t_stop = time.time()
        receiver.close()
        _clock_stop(out_dir, trainer, w.rank, time.time() - t_stop)
        print(f"trainer {w.rank}: {why}", file=sys.stderr, flush=True)
        if w.group_rank == 0:
            _record_stop(stopped, trainer, train_cfg.steps, str(why))
        return EXIT_REQUEUE
    except NonFiniteLoss as why:
        # This draft is lost, not the stream: its STOP tells the streamers to feed the others only.
        # No checkpoint: the last one is the last sound state.
        receiver.close()
        who = f"{variant} (trainer {w.rank})" if variant else f"trainer {w.rank}"
        print(f"error: {who}: {why}", file=sys.stderr, flush=True)
        if w.group_rank == 0:
            _record_stop(stopped, trainer, train_cfg.steps, str(why))
        return EXIT_DRAFT_FAILED
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
        if w.group_rank == 0:
            _record_stop(stopped, trainer, train_cfg.steps, msg)
        return EXIT_PEER_DIED
    return 0


def _clock_stop(out_dir: str | Path, trainer: Trainer, rank: int, stop_s: float) -> None:
    """This rank's parts of the preemption window (the drill's measurement beside the plan's model)."""
    c = trainer.stop_clock
    if trainer.signal_at is not None:
        preempt_clock.mark(out_dir, preempt_clock.SIGNAL, 0.0, at=trainer.signal_at, rank=rank)
    if "boundary_s" in c:
        preempt_clock.mark(out_dir, preempt_clock.BOUNDARY, c["boundary_s"], rank=rank)
    ckpt = latest_checkpoint(trainer.ckpt_dir) if trainer.rank == 0 else None  # its draft's rank 0
    size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file()) if ckpt is not None else None
    preempt_clock.mark(out_dir, preempt_clock.CHECKPOINT, c.get("checkpoint_s", 0.0), rank=rank, bytes=size)
    preempt_clock.mark(out_dir, preempt_clock.STREAM_STOP, stop_s, rank=rank)


def _record_stop(path: Path, trainer: Trainer, steps: int, cause: str) -> None:
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
