"""The trainer: DDP over trainer ranks, gradient accumulation, warmup + cosine LR, atomic
checkpoints with exact resume, and a clean stop on SIGUSR2/SIGTERM.

`Trainer.from_config` is the one assembly: online training's trainer ranks, the in-process
trainer of the CPU proving ground and gpu-check all build their trainer there, so a draft trained
any of those ways starts from the same weights, seed and precision.

Each optimizer step consumes `global_batch_size` samples: every rank runs `grad_accumulation`
micro-steps of `global / (ranks * accumulation)` samples packed into one row. The ledger of
consumed sample ids is identical on every rank (gathered each micro-step), so a checkpoint
from rank 0 tells any restart exactly which samples of the epoch are done.
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hpc.config.schema import DSparkConfig, TrainConfig
from hpc.data.prepare import regeneration_pending
from hpc.dist.planes import Planes, broadcast_text
from hpc.errors import UserError
from hpc.formats.checkpoint_layout import TrainState, latest_checkpoint
from hpc.formats.draft_args import DraftArgs, LossArgs
from hpc.model.blocks import check_attention
from hpc.model.dspark import DSparkDraft
from hpc.model.loss import PackedRow, dspark_loss
from hpc.model.target_weights import load_target_tensors
from hpc.model.teacher import TEACHER_ROLES, VerifierHead, target_head
from hpc.stream.sample import Capture, MicroBatch
from hpc.train.checkpoint import load_checkpoint, save_checkpoint
from hpc.train.integrity import AGREE, JUDGED, TeacherAgreement
from hpc.train.lr_schedule import lr_factor
from hpc.train.warm_start import warm_start
from hpc.verifier.target_files import architectures, text_config


class RequeueRequested(Exception):
    """Raised after the checkpoint that a preemption/termination signal asked for."""


class NonFiniteLoss(UserError):
    """The step's loss or gradient norm is NaN or infinite. Raised before the optimizer steps on
    it, on every rank of the draft at once (both are all-reduced), so the last checkpoint is sound."""


def pack(captures: list[Capture]) -> PackedRow:
    """Concatenate samples into one row; document ids keep blocks from seeing a neighbour. The ids
    and positions are made where the tokens are: a row of GPU captures is a GPU row throughout."""
    docs = [torch.full((c.input_ids_T.numel(),), i, dtype=torch.long, device=c.input_ids_T.device)
            for i, c in enumerate(captures)]
    return PackedRow(
        torch.cat([c.input_ids_T for c in captures]), torch.cat([c.loss_mask_T for c in captures]),
        torch.cat([c.aux_TnH for c in captures]), torch.cat([c.last_hidden_TH for c in captures]),
        torch.cat(docs), torch.cat([torch.arange(c.input_ids_T.numel(), device=c.input_ids_T.device)
                                    for c in captures]),
    )


class DraftLoss(nn.Module):
    """The draft plus its objective as one forward, so DDP's gradient hooks see the whole step."""

    def __init__(self, model: DSparkDraft):
        super().__init__()
        self.model = model

    def forward(self, row: PackedRow, head: VerifierHead, weights: LossArgs, max_anchors: int,
                generator: torch.Generator, attention: str):
        return dspark_loss(self.model, row, head, weights, max_anchors, generator, attention)


def build_draft(args: DraftArgs, target_dir: str, vocab_file: str | Path, norm: bool,
                train_lm_head: bool = False) -> tuple[DSparkDraft, VerifierHead]:
    """The draft with the target's frozen embedding and lm_head rows, and the verifier head."""
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


def _dist(group) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def greedy_rows(cfg: DSparkConfig) -> bool:
    """Whether the rows trained on are the target's greedy replies: regenerated at temperature 0,
    and the regeneration finished (a hand-run `dspark train` before it reads the sources as they are)."""
    return bool(cfg.data.regenerate) and cfg.data.regen_temperature == 0 and not regeneration_pending(cfg.data)


class Trainer:
    def __init__(self, train_cfg: TrainConfig, model: DSparkDraft, head: VerifierHead, export_config: dict,
                 out_dir: str | Path, device: str | torch.device = "cpu", autocast_dtype: torch.dtype | None = None,
                 group=None, control_group=None, epoch_size: int | None = None, greedy_rows: bool = False):
        self.cfg = train_cfg
        self.epoch_size = epoch_size  # rows per epoch: lets the ledger forget finished epochs
        # Trainer ranks only, on two planes (hpc.dist.planes): `group` on the training backend
        # carries DDP's gradients, `control_group` (gloo) the bookkeeping on CPU tensors.
        self.group = group
        self.control_group = control_group if control_group is not None else group
        self.rank, self.world = _dist(group)
        self.model = model.to(device)
        self.head = head.to(device)
        # Every sample's states are checked before they train (greedy rows: against the teacher too).
        self.integrity = TeacherAgreement(self.head, train_cfg.min_teacher_agreement, enforce=greedy_rows)
        self._checks: list[tuple[torch.Tensor, int, str, int]] = []  # this step's captures, judged at its read
        self.device = torch.device(device)
        # Buffers (d2t/t2d) are identical everywhere and never change: do not re-broadcast them.
        wrapped = DraftLoss(self.model)
        self.ddp = DDP(wrapped, broadcast_buffers=False, process_group=group) if self.world > 1 else wrapped
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=train_cfg.lr, weight_decay=train_cfg.weight_decay)
        self.generator = torch.Generator().manual_seed(train_cfg.seed * 1009 + self.rank)
        self.weights: LossArgs = train_cfg.loss
        self.export_config = export_config
        self.ckpt_dir = Path(out_dir) / "checkpoints"
        self.state = TrainState()
        self.autocast_dtype = autocast_dtype
        self.attention = check_attention(train_cfg.attention, self.device)  # fails here, not at step 1
        self.stop_requested = False
        self.signal_at: float | None = None  # wall clock of the first USR2/TERM (the preemption drill's start)
        self.stop_clock: dict[str, float] = {}  # the stop's step boundary and checkpoint, in seconds

    @classmethod
    def from_config(cls, cfg: DSparkConfig, out_dir: str | Path, *, vocab_file: str | Path | None = None,
                    draft: tuple[DSparkDraft, VerifierHead] | None = None, train: TrainConfig | None = None,
                    device: torch.device | str = "cpu", planes: Planes | None = None,
                    epoch_size: int | None = None, resume: bool = True) -> Trainer:
        """The trainer a config describes, resumed from `out_dir`'s newest checkpoint if any.

        Without `draft`, the draft is built from the target (`verifier.model`) and the prepared
        vocab, seeded by `train.seed` so that the same recipe starts from the same weights, and
        warm-started from `train.init_from` unless a checkpoint of its own is there to resume.
        gpu-check hands in a draft it built in place on the device (`draft`). `train` replaces
        `cfg.train` (a shortened run); `planes` are the trainer ranks' groups of an online world.
        """
        device = torch.device(device)
        train_cfg = train or cfg.train
        if draft is None:
            if vocab_file is None:
                raise ValueError("Trainer.from_config builds the draft from the prepared vocab: pass vocab_file")
            torch.manual_seed(train_cfg.seed)
            model, head = build_draft(replace(cfg.draft), cfg.verifier.model, vocab_file,
                                      train_cfg.apply_verifier_norm, train_cfg.train_lm_head)
            if train_cfg.init_from and latest_checkpoint(Path(out_dir) / "checkpoints", say=lambda _: None) is None:
                warm_start(model, cfg)
            archs = architectures(cfg.verifier.model)
        else:
            (model, head), archs = draft, []
        export = model.args.to_config_json(cfg.verifier.name or cfg.verifier.model, archs, model.args.max_n)
        trainer = cls(train_cfg, model, head, export, out_dir, device=device,
                      autocast_dtype=autocast_dtype(train_cfg, device),
                      group=planes.train_data if planes is not None else None,
                      control_group=planes.train_control if planes is not None else None, epoch_size=epoch_size,
                      greedy_rows=greedy_rows(cfg))
        if resume:
            trainer.resume()
        return trainer

    # -- resume / checkpoint -----------------------------------------------------------------
    def resume(self, path: str | Path | None = None) -> bool:
        path = Path(path) if path else self._latest_on_rank0()
        if path is None:
            return False
        self.state = load_checkpoint(path, self.model, self.opt, self.generator, self.control_group)
        if self.rank == 0:  # a re-run says where it picks up, so nobody wonders about a short run
            print(f"resuming from {path.name}: step {self.state.step}, {self.state.samples_seen} samples "
                  "already trained (each is trained once)", flush=True)
        return True

    def _latest_on_rank0(self) -> Path | None:
        """The checkpoint to resume, as rank 0 sees it: every rank must load the same step, and a
        shared filesystem's client caches can show ranks different newest checkpoints."""
        found = latest_checkpoint(self.ckpt_dir) if self.rank == 0 else None
        if self.world > 1:
            chosen = broadcast_text(str(found) if found is not None else None, self.control_group)  # gloo, CPU
            found = Path(chosen) if chosen is not None else None
        return found

    def checkpoint(self) -> Path:
        return save_checkpoint(self.ckpt_dir, self.model, self.export_config, self.opt, self.state, self.generator,
                               self.cfg.keep_checkpoints, self.control_group)

    # -- one optimizer step ----------------------------------------------------------------------
    @property
    def micro_batch_size(self) -> int:
        return self.cfg.global_batch_size // (self.world * self.cfg.grad_accumulation)

    def _micro_loss(self, mb: MicroBatch) -> tuple[torch.Tensor, dict]:
        a = self.model.args
        for i, cap in enumerate(mb.mine):  # a mismatched or broken capture must stop the run, not train on garbage
            cap.check(len(a.aux_layer_ids), a.target_hidden_size)
            # measured on the device now, judged at the step's one read, before the optimizer moves
            self._checks.append((self.integrity.measure(cap), cap.sample_id,
                                 mb.origins[i] if i < len(mb.origins) else "", cap.aux_TnH.shape[1]))
        mine = torch.stack([c[0] for c in self._checks[len(self._checks) - len(mb.mine):]]) if mb.mine else None
        row = pack(mb.mine)  # copies: the captures' buffers are free from here on
        if mb.release is not None:
            mb.release()
        row = row.to(self.device)
        enabled = self.autocast_dtype is not None and self.device.type == "cuda"
        with torch.autocast(self.device.type, dtype=self.autocast_dtype or torch.bfloat16, enabled=enabled):
            loss, metrics = self.ddp(row, self.head, self.weights, self.cfg.max_anchors, self.generator, self.attention)
        # Counts, averaged like every metric: their ratio is the step's share over all ranks.
        zero = torch.zeros((), device=loss.device)
        metrics["teacher_agree"] = mine[:, AGREE].sum().to(loss.device) if mine is not None else zero
        metrics["teacher_checked"] = mine[:, JUDGED].sum().to(loss.device) if mine is not None else zero
        return loss, metrics

    def step(self, micro_batches: list[MicroBatch]) -> dict[str, float]:
        cfg = self.cfg
        lr = cfg.lr * lr_factor(self.state.step, cfg.warmup_steps, cfg.steps, cfg.schedule.value, cfg.min_lr_ratio)
        for group in self.opt.param_groups:
            group["lr"] = lr
        # The metrics stay on the device until one read after the step: a float() per metric and
        # micro-batch would make the host wait for the GPU each time, so the next micro-batch's
        # packing could never overlap the compute. (The same float64 sums, in the same order.)
        sums: dict[str, torch.Tensor] = {}
        self._checks = []
        counted: torch.Tensor | float = 0.0  # micro-batches with a supervised slot: an empty one has no metric
        for i, mb in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            sync = self.ddp.no_sync() if (isinstance(self.ddp, DDP) and not last) else contextlib.nullcontext()
            with sync:
                loss, metrics = self._micro_loss(mb)
                (loss / len(micro_batches)).backward()
            scalars = {k: v.detach().double().reshape(()) for k, v in metrics.items() if v.numel() == 1}
            slots = scalars.get("supervised_slots")
            has_slots = slots > 0 if slots is not None else torch.zeros((), dtype=torch.bool)
            counted = counted + has_slots.double()
            for k, v in scalars.items():  # where, not a product: an empty row's NaN must not count
                sums[k] = sums.get(k, 0.0) + torch.where(has_slots.to(v.device), v, 0.0)
            self.state.record(mb.consumed, self.epoch_size, mb.skipped)
        extra: dict[str, torch.Tensor] = {}
        if cfg.grad_clip > 0:
            extra["grad_norm"] = self._clip(cfg.grad_clip)
        keys = sorted(sums)
        dev = self.device
        flat = torch.stack([sums[k].to(dev) for k in keys] + [torch.as_tensor(counted, dtype=torch.float64).to(dev)]
                         + [v.detach().double().to(dev) for v in extra.values()])
        n_read = flat.numel()
        checks = [c[0].to(dev) for c in self._checks]
        read = torch.cat([flat, *checks]).tolist()  # the one host sync
        width = checks[0].numel() if checks else 0
        for i, (_, sample_id, origin, n_aux) in enumerate(self._checks):
            m = read[n_read + i * width:n_read + (i + 1) * width]
            self.integrity.judge(m, sample_id, origin, n_aux)  # raises before the optimizer steps on it
        self._checks = []
        totals: dict[str, float] = dict(zip(extra, read[len(keys) + 1:]))
        means, counted_all = self._mean_over_ranks(dict(zip(keys, read[:len(keys)])), read[len(keys)])
        self._check_finite({**totals, **(means if counted_all else {})}, lr)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.state.step += 1
        totals = {**totals, **means}
        agree, checked = totals.pop("teacher_agree", 0.0), totals.pop("teacher_checked", 0.0)
        if checked > 0:
            totals["teacher_agreement"] = agree / checked
        totals["lr"] = lr
        self.state.losses.append(totals.get("loss", float("nan")))
        return totals

    def _clip(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients; returns their total norm. A detached confidence head is its own
        learner: clipped apart, its gradient never rescales the backbone's step, so the backbone
        trains exactly as it would without the head (tests/train/test_confidence_detach.py)."""
        clip = torch.nn.utils.clip_grad_norm_
        head = self.model.confidence_head
        if not self.weights.confidence_detach or head is None:
            return clip(self.model.parameters(), max_norm)
        mine = {id(q) for q in head.parameters()}
        rest = clip([q for q in self.model.parameters() if id(q) not in mine], max_norm)
        return torch.hypot(rest, clip(head.parameters(), max_norm))  # the norm over all, as logged before

    def _mean_over_ranks(self, sums: dict[str, float], counted: float) -> tuple[dict[str, float], float]:
        """Each metric's mean over the micro-batches of every rank that had a supervised slot, and
        how many had one. Every rank all-reduces the same keys (an empty micro-batch reports them at zero)."""
        keys = sorted(sums)
        t = torch.tensor([sums[k] for k in keys] + [float(counted)], dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(t, group=self.control_group)
        n = float(t[-1])
        return {k: float(v) / n if n else float("nan") for k, v in zip(keys, t[:-1])}, n

    def _check_finite(self, step_metrics: dict[str, float], lr: float) -> None:
        """A NaN or infinite loss (or gradient norm) ends this draft's training before the
        optimizer steps on it: every later step would train on garbage and export it."""
        bad = [f"{k} {step_metrics[k]}" for k in ("loss", "grad_norm")
               if k in step_metrics and not math.isfinite(step_metrics[k])]
        if bad:
            raise NonFiniteLoss(f"{', '.join(bad)} at step {self.state.step + 1} (lr {lr:.3g}): the optimizer did "
                                "not step on it; lower train.lr or raise train.warmup_steps, then re-run")

    # -- the loop -----------------------------------------------------------------------------
    def _install_signals(self) -> dict:
        """Slurm sends USR2 (--signal=USR2@cluster.signal_delay_s) before preemption and TERM on cancel/timeout."""
        def request_stop(signum, _frame):
            self.stop_requested = True
            self.signal_at = self.signal_at or time.time()
        return {sig: signal.signal(sig, request_stop) for sig in (signal.SIGUSR2, signal.SIGTERM)}

    def _agreed_stop(self) -> bool:
        if self.world == 1:
            return self.stop_requested
        flag = torch.tensor([1.0 if self.stop_requested else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.control_group)
        return bool(flag.item())

    def _all_ready(self, mine: bool) -> bool:
        """Whether every rank holds its step's batches, agreed on the gloo control plane. Only then
        does DDP post its all-reduce on the data plane: a rank still waiting for samples (a
        restarting verifier) must not hold the others inside an NCCL op that has a short timeout,
        and a rank whose stream ended must not leave the others waiting in one forever."""
        if self.world == 1:
            return mine
        flag = torch.tensor([0.0 if mine else 1.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.control_group)
        return not flag.item()

    def run(self, batches: Iterator[MicroBatch], on_step: Callable[[int, dict], None] | None = None,
            max_steps: int | None = None) -> TrainState:
        previous = self._install_signals()
        try:
            return self._run(batches, on_step, max_steps)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _run(self, batches: Iterator[MicroBatch], on_step, max_steps: int | None) -> TrainState:
        end = min(self.cfg.steps, max_steps) if max_steps is not None else self.cfg.steps
        while self.state.step < end:
            try:
                micro = [next(batches) for _ in range(self.cfg.grad_accumulation)]
            except StopIteration:
                micro = []
            if not self._all_ready(bool(micro)):
                break
            metrics = self.step(micro)
            if on_step is not None:
                on_step(self.state.step, metrics)
            stop = self._agreed_stop()
            boundary = time.time()
            if stop or self.state.step % self.cfg.checkpoint_interval == 0 or self.state.step == end:
                self.checkpoint()
            if stop:
                # what the preemption window spent here (hpc.train.preempt_clock)
                self.stop_clock = {"checkpoint_s": time.time() - boundary}
                if self.signal_at is not None:
                    self.stop_clock["boundary_s"] = max(0.0, boundary - self.signal_at)
                raise RequeueRequested(f"checkpointed at step {self.state.step}; requeue to continue")
        return self.state
