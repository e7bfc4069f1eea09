"""`dspark plan CONFIG`: how many trainer nodes one verifier node feeds, and what fits in memory.

Verifier nodes prefill samples with the target and stream hidden states; trainer nodes consume
them. Supply and demand are estimated from FLOPs unless `plan.*` holds measured rates, so the
same arithmetic sizes a Kimi-K2.6 allocation before anyone queues for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hpc.config.checker import Checker
from hpc.config.schema import DSparkConfig
from hpc.config.shared_sweep import share_key, shared_groups, train_nodes
from hpc.config.validate import ranks_per_node
from hpc.config.validate_ops import check_plan as plan_checks
from hpc.errors import UserError
from hpc.launch.plan_time import PipelineTime, pipeline_time
from hpc.model.inventory import BUFFER_ITEMSIZE, draft_shapes
from hpc.verifier.gpu_budget import (
    DTYPE_BYTES,
    headroom_bytes,
    samples_in_flight,
    shares_gpu_with_vllm,
    stream_dtype_name,
    streamer_items,
)
from hpc.verifier.vllm_support import default_capture_concurrency

GB = 1e9
IDS_BYTES_PER_TOKEN = 16  # token id + loss mask, int64 each (hpc.stream.protocol)
HEADER_BYTES = 64  # one int64[8] header per sample
LOSS_TENSORS = 8  # fp32 [Q, draft_vocab] tensors alive in the loss: logits, logp, p, logq, q, grads...
TILE_SLOTS = 256  # hpc.model.blocks.tiled_sdpa_attention_fn's default: block slots per SDPA tile

# Bytes each saved activation costs, per element of the named width, read off a training step's
# live tensors at its peak (the end of the loss's forward) with the dev tools' live-tensor
# tracker (memtrack), in fp32 and under bf16 autocast. Autocast keeps fp32 norms and casts each
# linear's input afresh (it caches weights only), which is why its per-h cost is not half of fp32's.
SLOT_H_BYTES = {False: 48, True: 41}  # per block slot per layer: norms, residuals, q/o, attention out
CTX_H_BYTES = {False: 12, True: 6}  # per context token: fc out and hidden_norm (fp32: 3 x 4 B; autocast: 4 + 2 B)
CTX_H_PER_LAYER = {False: 0, True: 4}  # autocast casts the normed context again for k_proj and v_proj
KV_BYTES = {False: 8, True: 6}  # per token per layer: k_proj/v_proj outputs, k_norm (fp32 + its cast)


@dataclass
class MemoryItem:
    what: str
    bytes: float
    how: str


@dataclass
class Plan:
    name: str
    # stream payload
    stream_dtype: str
    n_aux: int
    hidden: int
    bytes_per_token: int
    avg_seq_len: int
    bytes_per_sample: int
    # verifier supply, per verifier node
    prefill_tok_s: float
    prefill_estimated: bool
    prefill_samples_s: float
    link_bytes_s: float
    link_samples_s: float
    link_bound: bool
    supply_samples_s: float
    supply_bytes_s: float
    capture_concurrency: int
    capture_concurrency_set: bool
    # trainer demand, per trainer node
    gpus_per_node: int
    ranks_per_node: int
    micro_batch: int
    block_tokens_per_sample: float
    train_flops_per_sample: float
    trainer_samples_s_per_gpu: float
    trainer_estimated: bool
    demand_samples_s: float
    # balance
    trainer_nodes_per_verifier_node: float
    recommend_verifier_nodes: int
    recommend_trainer_nodes: int
    verifier_nodes: int
    trainer_nodes: int
    cluster_supply_samples_s: float
    cluster_demand_samples_s: float
    trainer_wait: float
    verifier_throttle: float
    run_hours: float
    # memory
    trainer_memory: list[MemoryItem]
    trainer_gpu_bytes: float
    gpu_bytes: float
    trainer_over: bool
    target_weight_bytes: float
    verifier_node_bytes: float
    kv_headroom_bytes: float
    verifier_over: bool
    streamer_memory: list[MemoryItem]  # on the verifier's last GPU, beside vLLM ([] when they do not share)
    streamer_headroom_bytes: float
    in_flight: int = 2  # stream.in_flight: samples on the wire per streamer -> trainer pair
    in_flight_total: int = 2  # the streamer's cap over all its trainers (its GPU's headroom)
    pipeline: PipelineTime | None = None  # every stage's time, and the preemption window (plan_time)
    timeslice_slowdown: float = 0.0  # prefill lost to the streamer on vLLM's last GPU
    timeslice_measured: bool = False
    shared: SharedPlan | None = None  # submit.share_verifier: K drafts from one verifier's capture


@dataclass
class SharedPlan:
    """One allocation training K variants from one verifier, against K allocations of V + T."""
    variants: int
    bytes_per_sample: int  # on the streamer's link: every sample goes to each of the K groups
    link_samples_s: float  # per verifier node, at K copies a sample
    supply_samples_s: float  # per verifier node: min(prefill, link at K copies)
    link_bound: bool
    group_demand_samples_s: float  # one variant's trainer nodes
    nodes: int  # V + K x T
    run_hours: float  # train.steps, every variant at once
    gpu_hours: float
    solo_run_hours: float
    solo_gpu_hours: float  # K allocations of V + T, one after another or side by side
    most_variants_link: int  # the most variants whose trainers the link still feeds at their demand
    key: str = "submit.share_verifier"  # what made it shared: the sweep's flag, or submit.ablations


def check_plan(cfg: DSparkConfig) -> None:
    """One-line UserError naming the first bad `plan.*` knob."""
    c = Checker()
    plan_checks(c, cfg)
    if c.problems:
        raise UserError(c.problems[0])


def _draft_params(cfg: DSparkConfig) -> dict[str, int]:
    """Element counts by role (bytes for the buffers), from the draft's tensor table: no torch on a
    login node."""
    out = dict.fromkeys(("embed", "lm_head", "fc", "kv", "layers", "markov_w2", "other", "buffers"), 0)
    for name, shape in draft_shapes(cfg).items():
        if name in BUFFER_ITEMSIZE:
            out["buffers"] += math.prod(shape) * BUFFER_ITEMSIZE[name]
            continue
        # markov_w1 is a trained lookup: it lands in "other", which costs memory but no FLOPs.
        role = next((r for prefix, r in (("embed_tokens", "embed"), ("lm_head", "lm_head"), ("fc.", "fc"),
                                         ("layers.", "layers"), ("markov_head.markov_w2", "markov_w2"))
                     if name.startswith(prefix)), "other")
        out[role] += math.prod(shape)
        out["kv"] += math.prod(shape) if ".k_proj." in name or ".v_proj." in name else 0
    return out


def _train_flops_per_sample(cfg: DSparkConfig, n: dict[str, int], seq: int, block_tokens: float) -> float:
    """6 x params x tokens for what is trained, 4x for the frozen lm_head (forward + input grad),
    2x for the verifier head (forward only), plus attention of each block query over its context."""
    d = cfg.draft
    lm = 6 if cfg.train.train_lm_head else 4
    attn = 12 * d.num_hidden_layers * d.num_attention_heads * d.head_dim * (seq / 2 + d.block_size)
    per_block_token = (6 * (n["layers"] + n["markov_w2"]) + lm * n["lm_head"]
                       + 2 * d.draft_vocab_size * cfg.verifier.hidden_size + attn)
    per_context_token = 6 * (n["fc"] + n["kv"])  # fc, then every layer's k/v over the context
    return block_tokens * per_block_token + seq * per_context_token


def _stream_buffer(cfg: DSparkConfig, micro: int, tok_bytes: int) -> MemoryItem:
    """The receive pool's worst case: every buffer it may hold grown to the longest sample.
    It holds the streamers' credit shares (hpc.stream.receiver: the buffer rounded up to a share
    per streamer) and, while a step packs, that step's micro-batches, whose credit went back
    when they were gathered."""
    streamers = cfg.cluster.verifier_nodes
    shares = -(-cfg.stream.buffer_per_trainer // streamers) * streamers
    step = cfg.train.grad_accumulation * micro
    longest = cfg.data.max_seq_len * tok_bytes  # the header travels on the CPU control plane
    return MemoryItem("stream buffer", (shares + step) * longest,
                      f"{shares + step} samples of data.max_seq_len: {shares} credited "
                      f"(stream.buffer_per_trainer={cfg.stream.buffer_per_trainer} over {streamers} streamers)"
                      f" + a step's {step} being packed")


def _trainer_memory(cfg: DSparkConfig, n: dict[str, int], micro_tokens: int, micro_block: int,
                    stream_buffer: MemoryItem, world: int) -> list[MemoryItem]:
    d, t = cfg.draft, cfg.train
    trainable = n["layers"] + n["fc"] + n["markov_w2"] + n["other"] + (n["lm_head"] if t.train_lm_head else 0)
    frozen = n["embed"] + (0 if t.train_lm_head else n["lm_head"])
    autocast = t.device != "cpu" and t.dtype in ("bfloat16", "float16")
    th = cfg.verifier.hidden_size
    items = [
        MemoryItem("draft params (fp32 master)", 4 * trainable, f"{_count(trainable)} trainable x 4 B"),
        MemoryItem("gradients (fp32)", 4 * trainable, "trainable x 4 B"),
        MemoryItem("AdamW states (2x fp32)", 8 * trainable, "trainable x 8 B (exp_avg, exp_avg_sq)"),
    ]
    if autocast:
        cached = trainable + (0 if t.train_lm_head else n["lm_head"])  # every linear's weight, frozen too
        items.append(MemoryItem(f"{t.dtype} weight cache", 2 * cached, "autocast's cast of every linear weight x 2 B"))
    if world > 1:
        items.append(MemoryItem("DDP gradient buckets", 4 * trainable, f"{world} ranks: a second fp32 copy of grads"))
    items += [
        MemoryItem("frozen embedding + lm_head", 4 * frozen + n["buffers"],
                   f"{_count(frozen)} x 4 B (target rows, fp32) + d2t/t2d"),
        MemoryItem("verifier head rows", 4 * d.draft_vocab_size * th + cfg.verifier.vocab_size,
                   "draft_vocab x target hidden x 4 B + t2d"),
        stream_buffer,
        *_activations(cfg, micro_tokens, micro_block, autocast),
    ]
    return items


def _activations(cfg: DSparkConfig, T: int, Q: int, autocast: bool) -> list[MemoryItem]:
    """What one micro-step holds at its peak, for T context tokens and Q block slots."""
    d, L = cfg.draft, cfg.draft.num_hidden_layers
    ab = 2 if autocast else 4
    sb = DTYPE_BYTES[stream_dtype_name(cfg)]
    h, i, kv, th = d.hidden_size, d.intermediate_size, d.num_key_value_heads * d.head_dim, cfg.verifier.hidden_size
    n_aux = len(cfg.verifier.aux_layer_ids)
    ctx_h = CTX_H_BYTES[autocast] + L * CTX_H_PER_LAYER[autocast]
    ctx = T * (sb * (n_aux + 1) * th + (2 * n_aux * th if autocast else 0) + ctx_h * h + L * KV_BYTES[autocast] * kv)
    block = Q * L * (SLOT_H_BYTES[autocast] * h + 4 * ab * i + KV_BYTES[autocast] * kv)
    if check_attention_kind(cfg) == "flex":
        attn: float = L * (T + Q) * kv * 2 * ab  # flex saves each layer's [context | block] K and V
        attn_how = f"flex: L x (T+Q) x kv x 2 x {ab} B (K, V)"
    else:
        # Tiled SDPA copies each tile's keys [context so far | its blocks] and builds its mask.
        tiles = max(math.ceil(Q / TILE_SLOTS), 1)
        span = T * (tiles + 1) / (2 * tiles) + TILE_SLOTS
        attn = L * tiles * span * (2 * kv * ab + TILE_SLOTS * ab)
        attn_how = f"tiled SDPA: L x {tiles} tiles x ~{span:,.0f} keys x (2 kv + {TILE_SLOTS} mask) x {ab} B"
    return [
        MemoryItem("context activations", ctx,
                   f"T={T:,} tokens: packed row ({n_aux}+1) x H x {sb} B, fc/norm {ctx_h} B x h, K/V per layer"),
        MemoryItem("block activations", block,
                   f"Q={Q:,} slots x L: {SLOT_H_BYTES[autocast]} B x h + 4 x {ab} B x i (MLP) + K/V"),
        MemoryItem("attention K/V", attn, attn_how),
        MemoryItem("logits + loss", LOSS_TENSORS * 4 * Q * d.draft_vocab_size,
                   f"{LOSS_TENSORS} fp32 [Q, draft_vocab] tensors"),
    ]


def check_attention_kind(cfg: DSparkConfig) -> str:
    """The attention the trainer will run (hpc.model.blocks.check_attention, without torch)."""
    kind = cfg.train.attention
    return ("flex" if cfg.train.device != "cpu" else "sdpa") if kind == "auto" else kind


def _recommend(ratio: float, supply: float, demand: float) -> tuple[int, int]:
    """(verifier, trainer) nodes with the fewest node-seconds per trained sample."""
    if ratio >= 1:
        options = [(1, t) for t in {max(1, math.floor(ratio)), math.ceil(ratio)}]
    else:
        options = [(v, 1) for v in {max(1, math.floor(1 / ratio)), math.ceil(1 / ratio)}]
    return min(sorted(options), key=lambda vt: (vt[0] + vt[1]) / min(vt[0] * supply, vt[1] * demand))


def capacity_plan(cfg: DSparkConfig) -> Plan:
    check_plan(cfg)
    p, c, t = cfg.plan, cfg.cluster, cfg.train
    seq = p.avg_seq_len or max(cfg.data.max_seq_len // 2, 1)
    dtype = stream_dtype_name(cfg)
    n_aux = len(cfg.verifier.aux_layer_ids)
    tok_bytes = (n_aux + 1) * cfg.verifier.hidden_size * DTYPE_BYTES[dtype] + IDS_BYTES_PER_TOKEN
    sample_bytes = seq * tok_bytes + HEADER_BYTES

    # One vLLM per verifier node, on tensor_parallel_size of its GPUs: the rest do not prefill.
    verifier_gpus = min(cfg.verifier.tensor_parallel_size, c.gpus_per_node)
    prefill = p.prefill_tok_s_per_node or (
        verifier_gpus * p.gpu_tflops * 1e12 * p.mfu / (2 * p.target_active_params_b * 1e9))
    # The streamer on vLLM's last GPU time-slices with its TP rank, which every all-reduce waits for.
    slowdown = (p.timeslice_slowdown or 0.0) if shares_gpu_with_vllm(cfg) else 0.0
    prefill *= 1 - slowdown
    link_bytes = p.link_gbps * 1e9 / 8
    link_samples = link_bytes / sample_bytes
    supply = min(prefill / seq, link_samples)

    in_flight = cfg.verifier.capture_concurrency or default_capture_concurrency(seq)

    ranks = ranks_per_node(cfg)
    world = c.trainer_nodes * ranks
    micro = max(t.global_batch_size // (world * t.grad_accumulation), 1)
    # max_anchors bounds the anchors of one packed micro-step row, not of one sample.
    micro_block = min(t.max_anchors, max(micro * seq - cfg.draft.block_size, 0)) * cfg.draft.block_size
    n = _draft_params(cfg)
    flops = _train_flops_per_sample(cfg, n, seq, micro_block / micro)
    per_gpu = p.trainer_step_samples_s_per_gpu or p.gpu_tflops * 1e12 * p.mfu / flops
    demand = min(per_gpu * ranks, link_samples)  # a trainer node's ingress is a link too

    ratio = supply / demand
    rec_v, rec_t = _recommend(ratio, supply, demand)
    c_supply, c_demand = c.verifier_nodes * supply, c.trainer_nodes * demand
    memory = _trainer_memory(cfg, n, micro * seq, micro_block, _stream_buffer(cfg, micro, tok_bytes), world)
    used = sum(m.bytes for m in memory)
    weights = p.target_params_b * 1e9 * p.target_bytes_per_param
    node_bytes = verifier_gpus * p.gpu_memory_gb * GB
    usable = cfg.verifier.gpu_memory_utilization * node_bytes
    pl = Plan(
        name=cfg.name, stream_dtype=dtype, n_aux=n_aux, hidden=cfg.verifier.hidden_size, bytes_per_token=tok_bytes,
        avg_seq_len=seq, bytes_per_sample=sample_bytes, prefill_tok_s=prefill,
        prefill_estimated=p.prefill_tok_s_per_node is None, prefill_samples_s=prefill / seq,
        link_bytes_s=link_bytes, link_samples_s=link_samples, link_bound=link_samples < prefill / seq,
        supply_samples_s=supply, supply_bytes_s=supply * sample_bytes, capture_concurrency=in_flight,
        capture_concurrency_set=cfg.verifier.capture_concurrency is not None, gpus_per_node=c.gpus_per_node,
        ranks_per_node=ranks, micro_batch=micro, block_tokens_per_sample=micro_block / micro,
        train_flops_per_sample=flops,
        trainer_samples_s_per_gpu=per_gpu, trainer_estimated=p.trainer_step_samples_s_per_gpu is None,
        demand_samples_s=demand, trainer_nodes_per_verifier_node=ratio, recommend_verifier_nodes=rec_v,
        recommend_trainer_nodes=rec_t, verifier_nodes=c.verifier_nodes, trainer_nodes=c.trainer_nodes,
        cluster_supply_samples_s=c_supply, cluster_demand_samples_s=c_demand,
        trainer_wait=max(0.0, 1 - c_supply / c_demand), verifier_throttle=max(0.0, 1 - c_demand / c_supply),
        run_hours=t.steps * t.global_batch_size / min(c_supply, c_demand) / 3600,
        trainer_memory=memory, trainer_gpu_bytes=used, gpu_bytes=p.gpu_memory_gb * GB,
        trainer_over=used > p.gpu_memory_gb * GB, target_weight_bytes=weights, verifier_node_bytes=node_bytes,
        kv_headroom_bytes=usable - weights,
        verifier_over=weights > usable,
        streamer_memory=[MemoryItem(*item) for item in streamer_items(cfg, world)] if shares_gpu_with_vllm(cfg) else [],
        in_flight=cfg.stream.in_flight, in_flight_total=samples_in_flight(cfg, world),
        streamer_headroom_bytes=headroom_bytes(cfg), timeslice_slowdown=slowdown,
        timeslice_measured=p.timeslice_slowdown is not None,
    )
    pl.pipeline = pipeline_time(cfg, pl)
    if (k := shared_groups(cfg)) > 1:
        pl.shared = _shared(cfg, pl, k)
    return pl


def _shared(cfg: DSparkConfig, pl: Plan, k: int) -> SharedPlan:
    """What sharing one verifier between k variants costs on its link and saves in GPU-hours."""
    c, t = cfg.cluster, cfg.train
    link = pl.link_bytes_s / (k * pl.bytes_per_sample)
    supply = min(pl.prefill_samples_s, link)
    group = c.trainer_nodes * pl.demand_samples_s
    hours = t.steps * t.global_batch_size / min(c.verifier_nodes * supply, group) / 3600
    gpus = max(c.gpus_per_node, 1)
    # The link still feeds every group at its trainers' demand up to this many copies a sample.
    most = int(c.verifier_nodes * pl.link_bytes_s / (pl.bytes_per_sample * group)) if group > 0 else k
    nodes = train_nodes(cfg)
    return SharedPlan(
        variants=k, bytes_per_sample=k * pl.bytes_per_sample, link_samples_s=link, supply_samples_s=supply,
        link_bound=link < pl.prefill_samples_s, group_demand_samples_s=group, nodes=nodes, run_hours=hours,
        gpu_hours=nodes * gpus * hours, solo_run_hours=pl.run_hours,
        solo_gpu_hours=k * (c.verifier_nodes + c.trainer_nodes) * gpus * pl.run_hours, most_variants_link=most,
        key=share_key(cfg))


def pipeline_problems(cfg: DSparkConfig) -> list[str]:
    """validate's and submit's lines for stages past their Slurm time or a short preemption window."""
    pipeline = capacity_plan(cfg).pipeline
    return list(pipeline.problems) if pipeline is not None else []


def _count(n: float) -> str:
    return next((f"{n / s:.3g} {u}" for s, u in ((1e9, "B"), (1e6, "M"), (1e3, "K")) if n >= s), f"{n:.0f}")
