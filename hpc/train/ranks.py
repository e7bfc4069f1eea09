"""Every rank of an online training world: started, supervised, and its role decided.

`dspark train` starts all ranks of the world as local processes; a node of a Slurm allocation
starts its own share (`hpc.launch.stages.train_allocation`). Both start them with `spawn_ranks`
and wait with `supervise`, so a failure ends the same way on a laptop and on a cluster: the
first rank that fails stops the others, and one line names the root cause.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

from hpc.config.schema import DSparkConfig
from hpc.config.secrets import scrub, scrubbed_traceback
from hpc.config.validate import control_timeout_s
from hpc.data.prepare import load_prepared, split_held_out
from hpc.dist.planes import flight_recorder_env, rank_device
from hpc.dist.world import World, init_world
from hpc.errors import EXIT_REQUEUE, UserError
from hpc.formats import draft_failure
from hpc.formats.checkpoint_layout import latest_checkpoint
from hpc.own_env import set_own
from hpc.train.streamer_rank import streamer_rank
from hpc.train.trainer_rank import stop_summary, trainer_rank
from hpc.verifier.gpu_budget import largest_sample_bytes


def rank_main(rank: int, cfg: DSparkConfig, n_trainers: int, n_streamers: int, master_addr: str, port: int,
              secret: str, parent_run_id: str | None = None, variants: list[DSparkConfig] | None = None) -> int:
    """Join the world, then play this rank's role: trainer ranks first, streamers after.

    `variants`: the drafts trained from this world's one stream, one group of trainers each; a
    trainer plays its group's variant, and the streamers the first (every variant captures alike).
    """
    w = World(rank, n_trainers, n_streamers, len(variants) if variants else 1)
    if variants:
        cfg = variants[max(w.group, 0)]
    out = Path(cfg.train.output_dir)
    # Every tensor of this rank, the block mask included, lives on its own GPU (cuda:LOCAL_RANK).
    device = rank_device(cfg.train.device, exclusive=cfg.train.dist_backend == "nccl")
    if device.type == "cpu":  # every rank of this world shares the machine's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // w.size))
    else:
        torch.set_float32_matmul_precision("high")  # TF32 for the fp32 matmuls autocast leaves
        torch.backends.cudnn.allow_tf32 = True
    # Every rank joins the world first; a streamer then starts its verifier inside the stream,
    # heartbeating while vLLM loads, so a verifier that never starts stops every rank within
    # seconds of its error. The group timeout still covers a collective that waits on a vLLM start.
    flight_recorder_env(out / "logs", cfg.train.dist_backend)
    if not w.is_trainer:
        # Preemption (USR2) and cancel (TERM) are the trainers' business: they checkpoint and then
        # end the stream. A streamer (and the vLLM it starts, which inherits this) keeps serving.
        for sig in (signal.SIGUSR2, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
    planes = init_world(w, cfg.train.dist_backend, device, master_addr, port, secret, timeout_s=control_timeout_s(cfg),
                        data_timeout_s=cfg.stream.nccl_timeout_s, sample_bytes=largest_sample_bytes(cfg))
    rows, vocab_file = load_prepared(out)
    rows = split_held_out(rows, cfg.train.hold_out_every)[0]  # the calibrate stage's rows: never streamed
    if not w.is_trainer:
        names = [v.eval.label or f"v{i}" for i, v in enumerate(variants)] if variants else None
        return streamer_rank(cfg, w, rows, planes, device, out, names)
    return trainer_rank(cfg, w, planes, vocab_file, len(rows), device, out, parent_run_id)


def rank_process(rank: int, cfg: DSparkConfig, T: int, V: int, addr: str, port: int, secret: str,
                 parent_run_id: str | None = None, local_rank: int = 0,
                 variants: list[DSparkConfig] | None = None) -> None:
    """The target of one rank's process (local `dspark train` or a node of a Slurm allocation).

    `local_rank` is the rank's index among the processes of its node: its GPU. `secret` is the
    job's rendezvous secret (hpc.dist.rendezvous): an argument, never in the environment that
    vLLM and the other children inherit.
    """
    set_own("LOCAL_RANK", str(local_rank))
    tb_file = Path(cfg.train.output_dir) / "logs" / f"rank{rank}-traceback.txt"

    def thread_died(args) -> None:  # a helper thread losing its peer: one line, traceback to the file
        tb_file.parent.mkdir(parents=True, exist_ok=True)
        with open(tb_file, "a") as f:
            f.write(scrub("".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback))))
        first = scrub(str(args.exc_value).splitlines()[0])[:200] if str(args.exc_value) else ""
        print(f"rank {rank}: thread {args.thread.name if args.thread else '?'}: {args.exc_type.__name__}: {first} "
              f"(traceback in {tb_file})", file=sys.stderr, flush=True)
    threading.excepthook = thread_died
    try:
        code = rank_main(rank, cfg, T, V, addr, port, secret, parent_run_id, variants)
    except UserError as err:
        print(f"error: rank {rank}: {scrub(str(err))}", file=sys.stderr)
        code = 2
    except Exception as err:  # noqa: BLE001 - usually the echo of another rank's death: one line here,
        # the traceback in a file, so the launcher's one-line cause is not buried under N tracebacks.
        tb_file.parent.mkdir(parents=True, exist_ok=True)
        with open(tb_file, "a") as f:
            f.write(scrubbed_traceback())
        print(f"rank {rank}: {type(err).__name__}: {scrub(str(err).splitlines()[0])[:200] if str(err) else ''} "
              f"(traceback in {tb_file})", file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # A receive thread of a dead peer can block forever in C++; interpreter teardown would abort.
    os._exit(code)


def spawn_ranks(cfg: DSparkConfig, ranks: list[int], local_ranks: list[int], T: int, V: int, addr: str, port: int,
                secret: str, parent_run_id: str | None = None, variants: list[DSparkConfig] | None = None) -> list:
    """Start `ranks` (global) as processes of this machine, each on its `local_ranks` GPU; `T`
    counts every group's trainers when `variants` share the stream."""
    ctx = mp.get_context("spawn")  # CUDA and gloo state never survive a fork
    procs = [ctx.Process(target=rank_process, args=(r, cfg, T, V, addr, port, secret, parent_run_id, local, variants),
                         name=f"rank{r}") for local, r in zip(local_ranks, ranks)]
    for p in procs:
        p.start()
    return procs


def supervise(procs, grace_s: float, drafts: list[int] | None = None) -> tuple[int, list[int | None]]:
    """Wait for every rank; the first failure stops the others (no half-alive world).

    The others get `grace_s` to checkpoint and exit on their own (they lose the same peer, and
    notice within the stream's peer timeout); whoever is still alive then is killed. Returns the
    code for the whole (EXIT_REQUEUE when every rank checkpointed on a stop signal) and each
    rank's own exit code, None for a rank killed here: a SIGKILL we sent is not the cause to report.

    `drafts`: each process's draft when several share one stream (-1: a streamer). A trainer's
    failure is then its draft's alone: that draft's ranks get `grace_s` and are stopped, the others
    go on, and the code is 0 once they finish; `failed_drafts(own, drafts)` names the failed ones.
    """
    drafts = drafts if drafts is not None else [-1] * len(procs)
    failed: dict[int, float] = {}  # a draft that failed on its own -> when its ranks' grace ends
    killed: set[int] = set()
    while True:
        now, codes = time.monotonic(), [p.exitcode for p in procs]
        for i, c in enumerate(codes):
            if drafts[i] >= 0 and c not in (None, 0, EXIT_REQUEUE):
                failed.setdefault(drafts[i], now + grace_s)
        for i, p in enumerate(procs):
            if drafts[i] in failed and codes[i] is None and now > failed[drafts[i]]:
                p.kill()
                killed.add(i)
        if any(c not in (None, 0) and drafts[i] not in failed for i, c in enumerate(codes)):
            break  # a streamer failed, or a stop signal: the whole world ends
        if all(c is not None for c in codes):
            return 0, [None if i in killed else c for i, c in enumerate(codes)]
        time.sleep(0.5)
    deadline = time.monotonic() + grace_s
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    killed |= {i for i, p in enumerate(procs) if p.is_alive()}
    for i in killed:
        procs[i].kill()
    for p in procs:
        p.join(10)
    own = [None if i in killed else p.exitcode for i, p in enumerate(procs)]
    mine = [i for i in range(len(procs)) if drafts[i] not in failed]  # the world's ranks, not a failed draft's
    if not killed & set(mine) and all(own[i] in (0, EXIT_REQUEUE) for i in mine):
        return EXIT_REQUEUE, own
    cause = _first_cause([own[i] for i in mine])
    return cause if cause != -9 else _first_cause(own), own


def _first_cause(codes: list[int | None]) -> int:
    causes = [c for c in codes if c not in (0, EXIT_REQUEUE, None)] or [-9]  # only ours: killed
    return causes[0]


def failed_drafts(own: list[int | None], drafts: list[int]) -> list[int]:
    """The drafts (of `supervise`'s `drafts`) whose ranks did not all finish."""
    return sorted({d for d, c in zip(drafts, own, strict=True) if d >= 0 and c != 0})


def record_draft_failure(cfg: DSparkConfig, d: int, own: list[int | None], drafts: list[int], n_trainers: int,
                         ranks: list[int] | None = None) -> str:
    """The line that names draft `d`'s failure, also written to its directory for its later stages
    and `dspark status` (hpc.formats.draft_failure). `own`/`drafts` are indexed like `ranks`
    (global ranks; default 0..n-1)."""
    codes: list[int | None] = [None] * (max(ranks or [len(own) - 1]) + 1)
    for r, c, of in zip(ranks or range(len(own)), own, drafts, strict=True):
        codes[r] = c if of == d else None
    name = cfg.eval.label or f"v{d}"
    cause = failure_line(codes, n_trainers, cfg.train.output_dir)
    # A draft on several trainer nodes: each node records what its own ranks saw. The node whose
    # rank was killed sees it at once, its peers only once they call it dead; their line (a lost
    # peer) must not overwrite that root cause. (The trainers clear the file as they start.)
    if exit_cause(codes, n_trainers) is not None or draft_failure.read(cfg.train.output_dir) is None:
        draft_failure.record(cfg.train.output_dir, name, cause)
    return f"variant {name} ({cfg.train.output_dir}): {cause}"


def grace_s(cfg: DSparkConfig) -> float:
    """How long the ranks left after a failure get to notice it and checkpoint: the stream's peer
    timeout (when a rank calls a silent peer dead) and time to write a checkpoint."""
    return cfg.stream.peer_timeout_s + 30.0


def exit_cause(codes: list[int | None], n_trainers: int) -> str | None:
    """The root cause among ranks' exit codes, in one line: a rank killed by a signal (the OOM
    killer, a user) is named first, since every other rank only failed because it lost that one."""
    def who(r: int) -> str:
        return f"rank {r} (trainer {r})" if r < n_trainers else f"rank {r} (streamer of verifier node {r - n_trainers})"
    for r, c in enumerate(codes):
        if c is not None and c < 0:
            try:
                name = signal.Signals(-c).name
            except ValueError:
                name = f"signal {-c}"
            hint = " (the kernel's OOM killer does this: check the node's memory)" if -c == signal.SIGKILL else ""
            return f"{who(r)} was killed by {name}{hint}; the other ranks stopped because they lost it"
    return None


def failure_line(codes: list[int | None], n_trainers: int, out_dir: str | Path) -> str:
    """The one line a failed training ends with, in `dspark train` and the Slurm stage alike: the
    root cause, and whether a re-run resumes from a checkpoint. `codes` are indexed by global
    rank; None for a rank whose code is not a cause (not on this node, or stopped by us)."""
    cause = exit_cause(codes, n_trainers)
    if cause is None:
        summary = stop_summary(out_dir)  # the trainers said why they stopped, resume included
        if summary:
            return summary
        cause = "a rank failed; its error is in the lines above"
    ckpt = latest_checkpoint(Path(out_dir) / "checkpoints", say=lambda _: None)
    resume = (f"checkpoint {ckpt.name} is saved and a re-run resumes from it" if ckpt
              else "no checkpoint yet, a re-run starts over")
    return f"{cause}; {resume}"


def exit_status(code: int) -> int:
    """A process exit status for a rank's code: a signal (-9) as the shell writes it (137), not
    the 247 that exit(-9) would give."""
    return 128 - code if code < 0 else code
