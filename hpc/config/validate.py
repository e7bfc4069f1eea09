"""Login-node checks: everything about a config that can be known without a GPU.

Each check appends one line `key = value: what is wrong; what to do`. `validate` returns them
all so a user fixes a config in one round trip instead of one submit per typo.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from hpc.config.checker import Checker, looks_like_path
from hpc.config.inputs import check_leaves, check_names, check_repeats
from hpc.config.schema import DRAFT_FROM_VERIFIER, DataSource, DSparkConfig, FinalHidden, SourceKind
from hpc.config.target import is_local, looks_like_hub_id
from hpc.config.validate_eval import check_eval
from hpc.config.validate_ops import check_extra_args, check_paths, check_plan
from hpc.config.validate_ops import check_tracking as tracking_checks
from hpc.config.validate_serve import check_serve
from hpc.config.validate_target import TargetShape, check_target, shape_once
from hpc.formats.slurm_time import TIME_FIX, parse_slurm_time, parse_time

# What vLLM's --dtype takes (vllm.config.model.ModelDType, 0.32).
VLLM_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
MARKOV_HEADS = ("vanilla",)
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class CheckContext:
    """What a stage's own check is handed besides the config (see `validate`'s `owners`)."""
    shape: TargetShape  # the target's config.json, read once per target
    runs_here: bool  # the work runs on this machine, so its devices count
    check_vllm: bool  # False for a sweep's variants: none may change the interpreter vLLM runs from


# A stage's check of the keys only it understands: one line per problem, into the Checker.
OwnerCheck = Callable[[Checker, DSparkConfig, CheckContext], None]


def _check_cluster(c: Checker, cfg: DSparkConfig) -> None:
    cl = cfg.cluster
    c.one_of("cluster.executor", cl.executor, ("slurm", "local"))
    for role in ("verifier", "trainer", "eval", "regenerate"):
        n = getattr(cl, f"{role}_nodes")
        if n < 1:
            c.fail(f"cluster.{role}_nodes", n, f"every role needs at least one node; set cluster.{role}_nodes >= 1")
    if cl.eval_nodes > 1:
        c.fail("cluster.eval_nodes", cl.eval_nodes, "an evaluation runs on one node (each node of a larger job would "
               "run all of it again and upload it again); set 1: the eval jobs of a sweep run side by side")
    c.nonneg("cluster.gpus_per_node", cl.gpus_per_node)
    t = cfg.train
    if cl.gpus_per_node == 0 and (t.device.startswith("cuda") or t.dist_backend == "nccl"):
        # Submitted without --gres, the trainers would fail inside their job, after the queue.
        c.fail("cluster.gpus_per_node", 0, f"train.device={t.device} and train.dist_backend={t.dist_backend} need "
               "GPUs; set the node's GPU count (e.g. 8), or train.device=cpu with train.dist_backend=gloo")
    c.positive("cluster.cpus_per_task", cl.cpus_per_task)
    if cl.ray_object_store_mb < 80:  # Ray refuses less than ~75 MiB
        c.fail("cluster.ray_object_store_mb", cl.ray_object_store_mb, "Ray needs at least 80 (MiB)")
    try:
        parse_slurm_time(cl.time)
    except ValueError:
        c.fail("cluster.time", cl.time, f"not a Slurm time; {TIME_FIX}")
    if not 0 <= cl.signal_delay_s <= 65535:
        c.fail("cluster.signal_delay_s", cl.signal_delay_s, "must be 0..65535 seconds")
    if not cl.partition:
        c.fail("cluster.partition", cl.partition, "set the Slurm partition to run in (see `sinfo`)")


def _check_verifier(c: Checker, cfg: DSparkConfig) -> None:
    v = cfg.verifier
    for key, value, what in (("verifier.model", v.model, "the target: a hub id (moonshotai/Kimi-K2.6) or a local "
                              "model directory"), ("verifier.entrypoint", v.entrypoint,
                              "the module vLLM's server runs as, vllm.entrypoints.openai.api_server")):
        if not str(value).strip():
            c.fail(key, value, f"empty; name {what}")
    if v.model and looks_like_hub_id(v.model) and Path(v.model).exists():
        c.fail("verifier.model", v.model, f"names a hub id, and ./{v.model} exists here too; write ./{v.model} "
               "(or an absolute path) for the directory, or remove it to use the hub id")
    else:
        c.path("verifier.model", v.model, "target model directory")
    if v.model and looks_like_path(v.model) and is_local(v.model):
        if not (Path(v.model).expanduser() / "config.json").is_file():
            c.fail("verifier.model", v.model, "directory has no config.json; point it at an HF model directory")
    c.path("verifier.tokenizer", v.tokenizer, "tokenizer directory")
    ids = list(v.aux_layer_ids)
    if not ids:
        c.fail("verifier.aux_layer_ids", ids, "need at least one layer id, e.g. [1, 29, 57]")
    if len(set(ids)) != len(ids) or ids != sorted(ids):
        c.fail("verifier.aux_layer_ids", ids, "must be strictly increasing without repeats")
    c.positive("verifier.tensor_parallel_size", v.tensor_parallel_size)
    gpus = cfg.cluster.gpus_per_node
    if gpus > 0 and v.tensor_parallel_size > gpus:
        c.fail("verifier.tensor_parallel_size", v.tensor_parallel_size,
               f"larger than cluster.gpus_per_node={gpus}; tensor parallelism stays inside one node")
    c.positive("verifier.max_model_len", v.max_model_len)
    if not 0 < v.gpu_memory_utilization <= 1:
        c.fail("verifier.gpu_memory_utilization", v.gpu_memory_utilization, "must be in (0, 1]")
    c.one_of("verifier.dtype", v.dtype, VLLM_DTYPES)
    if v.host not in ("127.0.0.1", "localhost", "::1") and not v.allow_remote_host:
        c.fail("verifier.host", v.host, "our vLLM servers listen for this node's clients only; use 127.0.0.1, "
               "or set verifier.allow_remote_host=true to expose them (API key still required)")
    if not 0 <= v.port <= 65535:
        c.fail("verifier.port", v.port, "must be a TCP port 1..65535, or 0 for any free port")

    check_extra_args(c, v.extra_args)
    users = vllm_users(cfg)
    if users:
        _check_interpreter(c, cfg, users[0])
    c.positive("verifier.health_timeout_s", v.health_timeout_s)
    c.positive("verifier.capture_retry_s", v.capture_retry_s)
    if v.capture_concurrency is not None:
        c.positive("verifier.capture_concurrency", v.capture_concurrency)
    norm_pairs = {
        (FinalHidden.pre_norm, False): "a pre-norm capture trains against wrong targets unless "
        "train.apply_verifier_norm=true; set one of the two",
        (FinalHidden.post_norm, True): "the capture is already post-norm, so applying the norm again "
        "double-normalises; set train.apply_verifier_norm=false",
    }
    norm_msg = norm_pairs.get((v.final_hidden, cfg.train.apply_verifier_norm))
    if norm_msg:
        c.fail("verifier.final_hidden", v.final_hidden.value, norm_msg)


def _check_interpreter(c: Checker, cfg: DSparkConfig, user: str) -> None:
    """verifier.python names the venv vLLM runs from (what that vLLM serves is the verifier's check)."""
    v = cfg.verifier
    if "/" not in v.python and cfg.cluster.executor == "slurm":
        # Each node would look the name up on its own PATH: the login node can vouch for none of them.
        c.fail("verifier.python", v.python, f"a bare name is looked up on each node's PATH, which this login node "
               f"cannot check, and vLLM runs from it ({user}); give the absolute path of its venv's interpreter "
               "(.../bin/python) on a filesystem every node mounts")
    elif not vllm_interpreter(cfg):
        c.fail("verifier.python", v.python, f"interpreter not found, and vLLM runs from it ({user}); "
               "point it at the venv vLLM is installed in (bin/python)")


def vllm_users(cfg: DSparkConfig) -> list[str]:
    """Why this config runs vLLM at all, first reason first. vLLM also answers the regeneration and
    serves the evaluation's baseline and third-party drafts, whatever backend captures the states."""
    engine = getattr(cfg.eval.engine, "value", cfg.eval.engine)
    return [why for why, on in (
        ("verifier.backend=vllm", cfg.verifier.backend.value == "vllm"),
        ("data.regenerate=true", cfg.data.regenerate),
        (f"eval.engine={engine}", engine != "reference"),
        ("eval.compare", any(d.method not in ("dspark", "dflash") for d in cfg.eval.compare))) if on]


def vllm_interpreter(cfg: DSparkConfig) -> str | None:
    """The interpreter at verifier.python as this machine finds it; None where it cannot vouch for one."""
    python = cfg.verifier.python
    if "/" not in python:
        return None if cfg.cluster.executor == "slurm" else shutil.which(python)
    path = Path(python).expanduser()
    return str(path) if path.is_file() else None


def _check_draft(c: Checker, cfg: DSparkConfig) -> None:
    d = cfg.draft
    # The target's dims, which the draft section repeats so that the model reads one class: they
    # follow verifier.* unless a config writes them, and then they must agree.
    # (draft.hidden_size is held to the target's config.json in validate_target.py.)
    for key, source in DRAFT_FROM_VERIFIER.items():
        mine, theirs = getattr(d, key), getattr(cfg.verifier, source)
        if key != "hidden_size" and mine != theirs:
            c.fail(f"draft.{key}", mine, f"is the target's: leave it out (it follows verifier.{source}={theirs}) "
                                         f"or set verifier.{source} instead")
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "intermediate_size", "block_size", "draft_vocab_size"):
        c.positive(f"draft.{key}", getattr(d, key))
    c.positive("draft.rope_theta", d.rope_theta)
    c.positive("draft.rms_norm_eps", d.rms_norm_eps)
    if d.num_key_value_heads > 0 and d.num_attention_heads % d.num_key_value_heads:
        c.fail("draft.num_key_value_heads", d.num_key_value_heads,
               f"must divide draft.num_attention_heads={d.num_attention_heads} (grouped-query attention)")
    if d.head_dim % 2:
        c.fail("draft.head_dim", d.head_dim, "must be even for rotary embeddings")
    c.nonneg("draft.markov_rank", d.markov_rank)
    c.one_of("draft.markov_head_type", d.markov_head_type, MARKOV_HEADS)
    if d.markov_rank == 0 and not d.enable_confidence_head and d.sample_from_anchor:
        c.fail("draft.sample_from_anchor", True, "a DFlash-layout draft (markov_rank=0, no confidence head) "
               "exports in vLLM's dflash format, which has no anchor slot; set draft.sample_from_anchor=false")
    if d.enable_confidence_head and d.confidence_head_with_markov and d.markov_rank == 0:
        c.fail("draft.confidence_head_with_markov", True,
               "needs a Markov head; set draft.markov_rank > 0 or confidence_head_with_markov=false")
    if cfg.eval.num_speculative_tokens:
        largest = max(cfg.eval.num_speculative_tokens)
        # Without sample_from_anchor slot 0 is the bonus token (hpc.formats.draft_args.DraftArgs.max_n),
        # as in every DFlash-layout draft: the block drafts one token fewer.
        bonus = not d.sample_from_anchor
        room = d.block_size - (1 if bonus else 0)
        if room < largest:
            why = " (slot 0 is the bonus token: draft.sample_from_anchor=false)" if bonus else ""
            c.fail("draft.block_size", d.block_size,
                   f"holds at most {room} speculative tokens{why}, fewer than the largest eval n={largest}; "
                   "raise draft.block_size or lower eval.num_speculative_tokens")


def _check_traffic(c: Checker, key: str, src: DataSource) -> None:
    if not Path(src.path).expanduser().exists():
        c.fail(f"{key}.path", src.path, "kind: traffic reads the JSONL the serving stack logged, and there is no "
               "such file or directory here; fix the path")
    if not (src.max_age_days > 0 and math.isfinite(src.max_age_days)):
        c.fail(f"{key}.max_age_days", src.max_age_days, "must be > 0: the days of traffic before `until` to read")
    if src.until is not None and parse_time(src.until) is None:
        c.fail(f"{key}.until", src.until, "not a time; use ISO 8601 (e.g. 2026-12-05T03:00:00Z), or leave it out "
               "for the time of submission")


def _check_data(c: Checker, cfg: DSparkConfig) -> None:
    data = cfg.data
    if not data.sources:
        c.fail("data.sources", [], "need at least one source (HF dataset id or local .jsonl/.parquet)")
    for i, src in enumerate(data.sources):
        if not src.path:
            c.fail(f"data.sources[{i}].path", src.path, "empty; give an HF dataset id or a local file")
        c.path(f"data.sources[{i}].path", src.path, "data file")
    for key, sources in (("data.sources", data.sources), ("data.calibration_sources", data.calibration_sources)):
        for i, src in enumerate(sources):
            if src.max_rows is not None and src.max_rows < 1:
                c.fail(f"{key}[{i}].max_rows", src.max_rows, "reads no row; give at least 1, or null for every row")
            if src.kind == SourceKind.traffic:
                _check_traffic(c, f"{key}[{i}]", src)
    for i, src in enumerate(data.calibration_sources):
        if not src.path:
            c.fail(f"data.calibration_sources[{i}].path", src.path,
                   "empty; give a local file (e.g. from `dspark calibration-set CONFIG OUT`) or an HF dataset id")
        c.path(f"data.calibration_sources[{i}].path", src.path, "data file")
        if not data.regenerate and _prompts_only(src.path):
            c.fail(f"data.calibration_sources[{i}].path", src.path, "its rows have no assistant turn (prompts, as "
                   "`dspark calibration-set` writes); set data.regenerate=true so the target answers them")
    c.positive("data.max_seq_len", data.max_seq_len)
    if data.max_seq_len <= cfg.draft.block_size:
        c.fail("data.max_seq_len", data.max_seq_len, f"must exceed draft.block_size={cfg.draft.block_size}")
    if data.max_seq_len >= cfg.verifier.max_model_len:  # a capture prefills the row plus the one token asked for
        c.fail("data.max_seq_len", data.max_seq_len,
               f"must be below verifier.max_model_len={cfg.verifier.max_model_len} (a capture prefills the row "
               "and generates one token); raise that or lower this")
    c.nonneg("data.regen_temperature", data.regen_temperature)
    c.positive("data.regen_max_tokens", data.regen_max_tokens)
    c.positive("data.regen_concurrency", data.regen_concurrency)


def _prompts_only(path: str) -> bool:
    """A local .jsonl whose first row has no assistant turn (one line read: cheap on a login node)."""
    p = Path(path).expanduser()
    if p.suffix != ".jsonl" or not p.is_file():
        return False
    with p.open(encoding="utf-8", errors="replace") as f:
        first = next((line for line in f if line.strip()), "")
    try:
        row = json.loads(first)
        turns = row.get("messages") or row.get("conversations") or []
        return not any(t.get("role") == "assistant" or t.get("from") in ("gpt", "assistant") for t in turns)
    except (ValueError, AttributeError):
        return False  # reading the rows reports a malformed file with its line number


def ranks_per_node(cfg: DSparkConfig) -> int:
    """Trainer ranks per trainer node: the one place `train.ranks_per_node: null` is resolved."""
    return cfg.train.ranks_per_node or max(cfg.cluster.gpus_per_node, 1)


def control_timeout_s(cfg: DSparkConfig) -> float:
    """The gloo control plane's timeout: long enough for a collective that waits on a vLLM start."""
    return cfg.verifier.health_timeout_s + 600


def trainer_ranks(cfg: DSparkConfig) -> int:
    return cfg.cluster.trainer_nodes * ranks_per_node(cfg)


def _check_train(c: Checker, cfg: DSparkConfig) -> None:
    t = cfg.train
    c.positive("train.lr", t.lr, "e.g. 3e-4")
    c.positive("train.steps", t.steps)
    c.nonneg("train.warmup_steps", t.warmup_steps)
    if t.steps > 0 and t.warmup_steps >= t.steps:
        c.fail("train.warmup_steps", t.warmup_steps, f"must be < train.steps={t.steps}")
    if not 0 <= t.min_lr_ratio <= 1:
        c.fail("train.min_lr_ratio", t.min_lr_ratio, "must be in [0, 1]")
    c.nonneg("train.weight_decay", t.weight_decay)
    c.nonneg("train.grad_clip", t.grad_clip)
    c.positive("train.global_batch_size", t.global_batch_size)
    c.positive("train.grad_accumulation", t.grad_accumulation)
    c.positive("train.max_anchors", t.max_anchors)
    c.positive("train.checkpoint_interval", t.checkpoint_interval)
    c.positive("train.keep_checkpoints", t.keep_checkpoints)
    if t.ranks_per_node is not None:
        c.positive("train.ranks_per_node", t.ranks_per_node)
    if t.hold_out_every == 1 or t.hold_out_every < 0:
        c.fail("train.hold_out_every", t.hold_out_every, "would hold out every row or none; use 0 (hold none out) "
               "or N >= 2 (every N-th row calibrates the confidence head), e.g. 50")
    loss = t.loss
    for key in ("ce_weight", "tv_weight", "kl_weight", "confidence_weight"):
        c.nonneg(f"train.loss.{key}", getattr(loss, key))
    if loss.ce_weight + loss.tv_weight + loss.kl_weight <= 0:
        c.fail("train.loss", "all zero", "at least one of ce_weight, tv_weight, kl_weight must be > 0")
    c.positive("train.loss.decay_gamma", loss.decay_gamma, "e.g. 4.0 for block_size 8")
    ranks = trainer_ranks(cfg)
    if (ranks > 0 and t.global_batch_size > 0 and t.grad_accumulation > 0
            and t.global_batch_size % (ranks * t.grad_accumulation)):
        c.fail("train.global_batch_size", t.global_batch_size,
               f"not divisible by trainer ranks x grad_accumulation = {ranks} x {t.grad_accumulation}; "
               f"use a multiple of {ranks * t.grad_accumulation}")
    c.device("train.device", t.device)
    c.one_of("train.dtype", t.dtype, DTYPES)
    if t.dtype == "float16" and t.device.startswith("cuda"):
        c.fail("train.dtype", t.dtype, "float16 needs loss scaling, which the trainer does not do; use bfloat16")
    c.one_of("train.dist_backend", t.dist_backend, ("nccl", "gloo"))
    if t.dist_backend == "nccl" and not t.device.startswith("cuda"):
        c.fail("train.dist_backend", "nccl", "NCCL needs CUDA devices; use gloo on CPU")
    gpus = cfg.cluster.gpus_per_node
    if t.dist_backend == "nccl" and t.ranks_per_node and gpus and t.ranks_per_node > gpus:
        c.fail("train.ranks_per_node", t.ranks_per_node, f"NCCL needs one GPU per rank and a node has "
               f"cluster.gpus_per_node={gpus}; use at most {gpus}")
    c.one_of("train.attention", t.attention, ("auto", "flex", "sdpa"))
    if t.init_from and t.init_from != "champion" and not (Path(t.init_from).expanduser() / "config.json").is_file():
        c.fail("train.init_from", t.init_from, "not a draft export directory (config.json + model.safetensors); "
               "point it at one, or use champion")


def _check_stream(c: Checker, cfg: DSparkConfig) -> None:
    st = cfg.stream
    c.one_of("stream.dtype", st.dtype, ("auto", *DTYPES))
    c.positive("stream.buffer_per_trainer", st.buffer_per_trainer)
    c.positive("stream.prefetch", st.prefetch)
    c.positive("stream.in_flight", st.in_flight)
    share = -(-st.buffer_per_trainer // max(cfg.cluster.verifier_nodes, 1))
    if 0 < share < st.in_flight:  # credits never let more than a share be on the wire
        c.fail("stream.in_flight", st.in_flight,
               f"exceeds a streamer's share of a trainer's receive buffer ({share} = stream.buffer_per_trainer / "
               f"cluster.verifier_nodes, rounded up); lower it or raise stream.buffer_per_trainer")
    c.positive("stream.heartbeat_s", st.heartbeat_s)
    if st.peer_timeout_s <= st.heartbeat_s:
        c.fail("stream.peer_timeout_s", st.peer_timeout_s, f"must exceed stream.heartbeat_s={st.heartbeat_s}")
    c.positive("stream.nccl_timeout_s", st.nccl_timeout_s)
    if st.nccl_timeout_s > control_timeout_s(cfg):
        c.fail("stream.nccl_timeout_s", st.nccl_timeout_s,
               f"exceeds the control plane's timeout ({control_timeout_s(cfg):.0f} s = verifier.health_timeout_s "
               "+ 600): a dead NCCL peer would outlast it; lower it (a few minutes)")
    t, ranks = cfg.train, trainer_ranks(cfg)
    if ranks > 0 and t.grad_accumulation > 0:
        micro = t.global_batch_size // (ranks * t.grad_accumulation)
        # A trainer returns credit only for a whole micro-batch: a smaller buffer never fills one,
        # and the heartbeats keep the peer timeout from ever firing.
        if 0 < st.buffer_per_trainer < micro:
            c.fail("stream.buffer_per_trainer", st.buffer_per_trainer,
                   f"a micro-batch takes {micro} samples per trainer (train.global_batch_size / ranks / "
                   f"grad_accumulation), which the buffer must hold; use at least {micro}")


def _check_devices_here(c: Checker, cfg: DSparkConfig) -> None:
    """Only where the work runs on this machine: a login node without GPUs is normal for Slurm."""
    t = cfg.train
    if t.device.startswith("cuda"):
        import torch  # torch: loaded only on this path

        if not torch.cuda.is_available():
            c.fail("train.device", t.device, "this machine has no CUDA device; use train.device=cpu "
                   "train.dist_backend=gloo, or run on a GPU node")


def validate(cfg: DSparkConfig, check_tracking: bool = True, runs_here: bool | None = None,
             check_vllm: bool = True, shapes: dict | None = None, owners: Sequence[OwnerCheck] = ()) -> list[str]:
    """All problems found, one line each; empty when the config is good to submit. `shapes`: a
    dict shared by calls that validate variants of one config, so the target is read once.
    `owners`: the checks of the stages above the config (the verifier's vLLM, the model's
    families, launch's schedule), which only they can make; see `resolver`."""
    c = Checker()
    check_leaves(cfg, c.fail)
    check_names(cfg, c.fail)
    check_repeats(cfg, c.fail)
    if runs_here is None:
        runs_here = cfg.cluster.executor == "local"
    if runs_here:
        _check_devices_here(c, cfg)
    shape = shape_once(c, cfg, shapes)
    _check_cluster(c, cfg)
    _check_verifier(c, cfg)
    _check_draft(c, cfg)
    check_target(c, cfg, shape)
    _check_data(c, cfg)
    _check_train(c, cfg)
    _check_stream(c, cfg)
    check_eval(c, cfg)
    tracking_checks(c, cfg, check_tracking)
    check_serve(c, cfg)
    check_plan(c, cfg)
    check_paths(c, cfg)
    context = CheckContext(shape=shape, runs_here=runs_here, check_vllm=check_vllm)
    for check in owners:
        check(c, cfg, context)
    return c.problems
