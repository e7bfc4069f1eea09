"""Every rank of an online training world runs `rank_main`: the rank decides the role.

On one machine (`dspark train`) the ranks are local processes over gloo; in a Slurm
allocation the launcher computes the same ranks from the node index. Trainer rank 0 owns the
progress display and the MLflow run; the last checkpoint is exported for vLLM at the end.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace
from pathlib import Path

import torch

from hpc.config.schema import DSparkConfig
from hpc.config.validate import control_timeout_s
from hpc.config.verifier_gpu import largest_sample_bytes, samples_in_flight
from hpc.dist.planes import flight_recorder_env
from hpc.own_env import set_own


def stream_dtype(cfg: DSparkConfig) -> torch.dtype:
    if cfg.stream.dtype != "auto":
        return getattr(torch, cfg.stream.dtype)
    return torch.bfloat16 if cfg.train.dist_backend == "nccl" else torch.float32


def capture_concurrency(cfg: DSparkConfig) -> int:
    """Capture requests in flight: the config's, else the plan's recommendation (HF: one, it is not thread-safe)."""
    if cfg.verifier.backend.value == "hf":
        return 1
    if cfg.verifier.capture_concurrency:
        return cfg.verifier.capture_concurrency
    from hpc.config.vllm_support import default_capture_concurrency

    return default_capture_concurrency(cfg.plan.avg_seq_len or max(cfg.data.max_seq_len // 2, 1))


def make_capture(cfg: DSparkConfig, device: str, log_dir: Path):
    """The configured verifier backend's capture function (called in the streamer)."""
    v = cfg.verifier
    if v.backend.value == "hf":
        from hpc.verifier.hf_backend import HFVerifier

        hf = HFVerifier(v.model, list(v.aux_layer_ids), v.final_hidden.value, device=device,
                        trust_remote_code=v.trust_remote_code)
        return hf.capture, None
    from hpc.verifier.vllm_backend import VLLMVerifier

    # A capture that times out means a hung server, unless /health says otherwise (then it is that
    # sample's failure). Request + health probe + exit wait stay within stream.peer_timeout_s, so
    # a hung verifier is reported as soon as the trainers' watchdog would call a streamer dead.
    peer = cfg.stream.peer_timeout_s
    verifier = VLLMVerifier(cfg.verifier, log_path=log_dir / f"vllm-verifier-{os.getpid()}.log",
                            request_timeout_s=0.6 * peer, file_timeout_s=0.6 * peer, probe_timeout_s=0.25 * peer)
    return verifier.capture, verifier


class Progress:
    """Step, loss, samples/s, data-wait share and ETA on one line (rich), for trainer rank 0."""

    def __init__(self, total: int, global_batch: int):
        from rich.progress import BarColumn, TextColumn, TimeRemainingColumn
        from rich.progress import Progress as RichProgress

        self.bar = RichProgress(TextColumn("[bold]train"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                                TextColumn("{task.fields[info]}"), TimeRemainingColumn())
        self.task = self.bar.add_task("train", total=total, completed=0, info="")
        self.total = total
        self.global_batch = global_batch
        # The step this job started from is known at its first step only (a resume happens after
        # this is made): counting from 0, a run resumed at 5000 credited 5000 steps to its first second.
        self.t0 = time.monotonic()
        self.start: int | None = None
        self.bar.start()

    def update(self, step: int, m: dict) -> dict:
        if self.start is None:
            self.start = step - 1
        done = step - self.start
        elapsed = max(time.monotonic() - self.t0, 1e-6)
        rate = done * self.global_batch / elapsed
        steps_per_s = done / elapsed
        extra = {"samples_per_s": rate, "data_wait_fraction": m.get("data_wait_s", 0.0) / elapsed,
                 "eta_s": (self.total - step) / steps_per_s if steps_per_s > 0 else float("nan")}
        self.bar.update(self.task, completed=step, info=f"loss {m.get('loss', float('nan')):.3f}  "
                        f"acc_len {m.get('accept_len', 0):.2f}  {rate:.1f} samples/s  "
                        f"wait {extra['data_wait_fraction']:.0%}")
        return extra

    def close(self) -> None:
        self.bar.stop()


_last_progress = [0.0]


def write_progress(path: Path, step: int, total: int, m: dict) -> None:
    """What `dspark status` shows for a running job: at most every 2 s, atomically."""
    import json

    now = time.monotonic()
    if now - _last_progress[0] < 2.0 and step != total:
        return
    _last_progress[0] = now
    data = {"step": step, "total": total, "loss": m.get("loss"), "samples_per_s": m.get("samples_per_s"),
            "eta_s": m.get("eta_s"), "updated": time.time()}
    from hpc.fsio import write_text

    write_text(path, json.dumps(data))


def rank_main(rank: int, cfg: DSparkConfig, n_trainers: int, n_streamers: int, master_addr: str, port: int,
              secret: str, parent_run_id: str | None = None) -> int:
    from hpc.dist.planes import rank_device
    from hpc.train.online import World, build_draft, init_world, run_trainer
    from hpc.train.prepare import load_prepared, split_held_out

    w = World(rank, n_trainers, n_streamers)
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
    group_timeout_s = control_timeout_s(cfg)
    flight_recorder_env(out / "logs", cfg.train.dist_backend)
    if not w.is_trainer:
        # Preemption (USR2) and cancel (TERM) are the trainers' business: they checkpoint and then
        # end the stream. A streamer (and the vLLM it starts, which inherits this) keeps serving.
        for sig in (signal.SIGUSR2, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
    planes = init_world(w, cfg.train.dist_backend, device, master_addr, port, secret, timeout_s=group_timeout_s,
                        data_timeout_s=cfg.stream.nccl_timeout_s, sample_bytes=largest_sample_bytes(cfg))
    rows, vocab_file = load_prepared(out)
    rows = split_held_out(rows, cfg.train.hold_out_every)[0]  # the calibrate stage's rows: never streamed
    if not w.is_trainer:
        return _stream(cfg, w, rows, planes, device, out)
    args = replace(cfg.draft)  # a copy: building the draft may set its positions
    torch.manual_seed(cfg.train.seed)  # the same recipe starts from the same weights, run after run
    model, head = build_draft(args, cfg.verifier.model, vocab_file, cfg.train.apply_verifier_norm,
                              cfg.train.train_lm_head)
    if cfg.train.init_from:
        from hpc.train.checkpoint import latest_checkpoint
        from hpc.train.warm_start import warm_start

        if latest_checkpoint(out / "checkpoints") is None:  # a resumed run must keep its own weights
            warm_start(model, cfg)
    logger = progress = None
    try:
        if w.rank == 0:
            from hpc.config import flatten
            from hpc.track.keys import STAGE, STAGE_TRAIN
            from hpc.track.logger import RunLogger
            from hpc.track.pipeline import common_tags

            logger = RunLogger(cfg.tracking.uri, cfg.tracking.experiment, f"train-{cfg.name}", parent_run_id,
                               tags={STAGE: STAGE_TRAIN, **common_tags(cfg)})
            from hpc.config.secrets import redacted

            logger.log_params(flatten(_as_dictconfig(redacted(cfg))))
            stats_file = out / "data" / "stats.json"
            if stats_file.is_file():  # skipped rows are counted once, by the preparing process
                import json

                logger.log_metrics(json.loads(stats_file.read_text()), step=0)
            from omegaconf import OmegaConf

            resolved = out / "config.yaml"
            resolved.write_text(OmegaConf.to_yaml(_as_dictconfig(redacted(cfg))))  # an artifact: no secrets
            logger.log_artifact(str(resolved))
            progress = Progress(cfg.train.steps, cfg.train.global_batch_size)

        def on_step(step: int, metrics: dict) -> None:
            if progress is not None and logger is not None:  # rank 0, which has both
                metrics.update(progress.update(step, metrics))
                logger.log_metrics({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step)
                write_progress(out / "progress.json", step, cfg.train.steps, metrics)

        # The training loop turns USR2/TERM into a checkpoint and a requeue. Outside it (setup, and the
        # export after the last step) a signal must not kill the rank: the default action would end
        # the node's task with 244 and fail a job whose training was complete.
        for sig in (signal.SIGUSR2, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        from hpc.verifier.target_files import architectures

        code = run_trainer(w, planes, cfg.train, cfg.stream, model, head, out, cfg.verifier.name or cfg.verifier.model,
                           on_step, epoch_size=len(rows), device=device, verifier_arch=architectures(cfg.verifier.model))
        if w.rank == 0:
            assert progress is not None  # made above on rank 0
            progress.close()
            from hpc.errors import EXIT_REQUEUE

            # A preempted run is KILLED (Slurm requeues it), a failed one FAILED: never left RUNNING.
            _finish(cfg, out, logger, export=code == 0,
                    status="FINISHED" if code == 0 else "KILLED" if code == EXIT_REQUEUE else "FAILED")
        return code
    except BaseException as err:
        # rank_process ends the process with os._exit: without this the run would stay RUNNING
        # and whatever the logger still buffers would be lost.
        _end_run_on_error(logger, progress, err)
        raise


def _end_run_on_error(logger, progress, err: BaseException) -> None:
    """Rank 0's MLflow run ends FAILED (KILLED for an interrupt) with its buffer sent, unless
    the run was already being closed when the error came."""
    if progress is not None:
        progress.close()
    if logger is not None and not logger.closed:
        # A short wait: the other ranks' launcher stops this one a few seconds after they fail.
        logger.close(timeout_s=10, status="KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED")


def _stream(cfg: DSparkConfig, w, rows, planes, device, out: Path) -> int:
    """A streamer rank: start the verifier, stream, stop the verifier; non-zero if it failed."""
    import sys

    from hpc.stream.streamer import run_streamer
    from hpc.train.online import EXIT_VERIFIER_FAILED, streamer_rows

    closers = []

    def start_capture():
        capture, closer = make_capture(cfg, str(device), out)  # cuda:N: capture threads have no current device
        closers.append(closer)
        return capture
    try:
        stats = run_streamer(streamer_rows(rows, w, cfg.train.seed, epochs=1000), None, planes, stream_dtype(cfg),
                             cfg.stream.prefetch, cfg.stream.heartbeat_s, capture_concurrency(cfg),
                             start_capture=start_capture, in_flight=cfg.stream.in_flight,
                             total_in_flight=samples_in_flight(cfg, len(planes.trainers)))
    finally:
        for closer in closers:
            if closer is not None:
                closer.close()
    print(f"streamer {w.rank}: sent {stats.sent} samples ({stats.bytes / 1e6:.1f} MB), "
          f"skipped {stats.failed} bad captures", flush=True)
    if stats.fatal:
        print(f"error: streamer {w.rank} (verifier node {w.rank - w.n_trainers}): {stats.fatal}",
              file=sys.stderr, flush=True)
        return EXIT_VERIFIER_FAILED
    return 0


def exit_cause(codes: list[int | None], n_trainers: int) -> str | None:
    """The root cause among ranks' exit codes, in one line: a rank killed by a signal (the OOM
    killer, a user) is named first, since every other rank only failed because it lost that one."""
    import signal as sig

    def who(r: int) -> str:
        return f"rank {r} (trainer {r})" if r < n_trainers else f"rank {r} (streamer of verifier node {r - n_trainers})"
    for r, c in enumerate(codes):
        if c is not None and c < 0:
            try:
                name = sig.Signals(-c).name
            except ValueError:
                name = f"signal {-c}"
            hint = " (the kernel's OOM killer does this: check the node's memory)" if -c == sig.SIGKILL else ""
            return f"{who(r)} was killed by {name}{hint}; the other ranks stopped because they lost it"
    return None


def failure_line(codes: list[int | None], n_trainers: int, out_dir: str | Path) -> str:
    """The one line a failed training ends with, in `dspark train` and the Slurm stage alike: the
    root cause, and whether a re-run resumes from a checkpoint. `codes` are indexed by global
    rank; None for a rank whose code is not a cause (not on this node, or stopped by us)."""
    from hpc.train.checkpoint import latest_checkpoint
    from hpc.train.online import stop_summary

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


def rank_process(rank: int, cfg: DSparkConfig, T: int, V: int, addr: str, port: int, secret: str,
                 parent_run_id: str | None = None, local_rank: int = 0) -> None:
    """The target of one rank's process (local `dspark train` or a node of a Slurm allocation).

    `local_rank` is the rank's index among the processes of its node: its GPU. `secret` is the
    job's rendezvous secret (hpc.dist.rendezvous): an argument, never in the environment that
    vLLM and the other children inherit.
    """
    import sys

    from hpc.config.secrets import scrub, scrubbed_traceback
    from hpc.errors import UserError

    set_own("LOCAL_RANK", str(local_rank))
    import threading
    import traceback

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
        code = rank_main(rank, cfg, T, V, addr, port, secret, parent_run_id)
    except UserError as err:
        print(f"error: rank {rank}: {scrub(str(err))}", file=sys.stderr)
        code = 2
    except Exception as err:  # noqa: BLE001 - usually the echo of another rank's death: one line here,
        # the traceback in a file, so the launcher's one-line cause is not buried under N tracebacks.
        path = tb_file
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(scrubbed_traceback())
        print(f"rank {rank}: {type(err).__name__}: {scrub(str(err).splitlines()[0])[:200] if str(err) else ''} "
              f"(traceback in {path})", file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # A receive thread of a dead peer can block forever in C++; interpreter teardown would abort.
    os._exit(code)

def _as_dictconfig(cfg: DSparkConfig):
    from omegaconf import OmegaConf

    return OmegaConf.structured(cfg)


def _finish(cfg: DSparkConfig, out: Path, logger, export: bool = True, status: str = "FINISHED") -> None:
    """Export the last checkpoint for vLLM, plot the loss curve, hand both to MLflow.

    Not after a preemption or a failure: an eval must never pick up a half-trained draft.
    """
    import json

    from hpc.model.export import export_draft, load_draft
    from hpc.track.plots import loss_curve_png
    from hpc.train.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(out / "checkpoints") if export else None
    if ckpt is not None:
        archs = json.loads((ckpt / "config.json").read_text())["speculators_config"]["verifier"]["architectures"]
        exported = export_draft(load_draft(ckpt), out / "export", cfg.verifier.name or cfg.verifier.model, archs,
                                max(cfg.eval.num_speculative_tokens))
        losses = json.loads((ckpt / "state.json").read_text())["losses"]
        png = loss_curve_png(losses, out / "loss_curve.png", title=cfg.name)
        logger.log_artifact(str(png))
        logger.log_artifact(str(exported / "config.json"), "export")
        logger.log_artifact(str(exported / "model.safetensors"), "export")
        print(f"exported {ckpt.name} -> {exported}", flush=True)
    if not logger.close(timeout_s=30, status=status):
        print(f"tracking server unreachable ({logger.last_error}); metrics kept only in {out}", flush=True)
