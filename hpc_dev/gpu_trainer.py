"""The gpu-check trainer: the real Trainer on a DSpark draft at the given dims (Kimi-K2.6's or
toy ones), built in place on the device, and synthetic micro-batches as the stream delivers
them. `scripts/gpu-check` and its two-rank checks (hpc_dev.gpu_pair) both build it here."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from hpc.config.schema import DSparkConfig
from hpc.launch.plan import IDS_BYTES_PER_TOKEN
from hpc.model.dspark import DSparkDraft
from hpc.stream.protocol import BufferPool
from hpc.stream.sample import Capture, MicroBatch
from hpc.verifier.gpu_budget import DTYPE_BYTES, stream_dtype_name


def config_for(d: dict, seq: int):
    cfg = DSparkConfig()
    cfg.draft.hidden_size, cfg.draft.num_hidden_layers = d["hidden"], d["layers"]
    cfg.draft.num_attention_heads, cfg.draft.num_key_value_heads = d["heads"], d["kv_heads"]
    cfg.draft.head_dim, cfg.draft.intermediate_size = d["head_dim"], d["intermediate"]
    cfg.draft.draft_vocab_size, cfg.draft.markov_rank, cfg.draft.block_size = d["draft_vocab"], d["markov"], d["block"]
    cfg.draft.mask_token_id = d["target_vocab"] - 1
    cfg.verifier.hidden_size, cfg.verifier.vocab_size = d["hidden"], d["target_vocab"]
    cfg.draft.target_hidden_size, cfg.draft.target_vocab_size = d["hidden"], d["target_vocab"]  # built, not loaded
    cfg.cluster.trainer_nodes, cfg.train.ranks_per_node = 1, 1
    cfg.train.global_batch_size, cfg.train.grad_accumulation = 1, 1
    cfg.train.max_anchors, cfg.train.steps, cfg.train.warmup_steps = d["anchors"], 100, 0
    cfg.train.checkpoint_interval, cfg.train.keep_checkpoints = 10 ** 6, 1
    # the longest row the check trains is the config's limit, so every length passes the plan's check
    cfg.data.max_seq_len = max(t for t, _ in d["steps"])
    cfg.verifier.max_model_len = cfg.data.max_seq_len + 1
    cfg.plan.avg_seq_len = seq
    return cfg


def build_trainer(d: dict, dev: torch.device, out: Path, planes=None):
    from hpc.model.teacher import VerifierHead  # safetensors: loaded only on this path
    from hpc.train.trainer import Trainer  # safetensors: loaded only on this path

    cfg = config_for(d, d["steps"][0][0])
    if dev.type == "cpu":
        cfg.train.device, cfg.train.dtype = "cpu", "float32"
    args = replace(cfg.draft)
    torch.manual_seed(0)
    with torch.device(dev):  # built in place: a Kimi draft is 7 GB in fp32
        model = DSparkDraft(args)
        model.t2d[: args.draft_vocab_size] = True
        head = VerifierHead(torch.randn(args.draft_vocab_size, args.target_hidden_size) * 0.02,
                            torch.ones(args.draft_vocab_size, dtype=torch.bool))
    cfg.verifier.name = "gpu-check"
    trainer = Trainer.from_config(cfg, out, draft=(model, head), device=dev, planes=planes, resume=False)
    return trainer, cfg


def sample(d: dict, seq: int, dev: torch.device, dtype: torch.dtype, i: int):
    g = torch.Generator().manual_seed(i)
    ids = torch.randint(0, d["target_vocab"] - 1, (seq,), generator=g)
    mask = torch.ones(seq, dtype=torch.long)
    mask[: seq // 10] = 0  # a prompt
    states = torch.randn(seq, 4, d["hidden"], generator=g).to(dev, dtype)  # 3 aux + last, as streamed
    return MicroBatch([Capture.from_states(i, ids.to(dev), mask.to(dev), states)], [(0, i)])


def receive_pool(cfg, dev: torch.device) -> list[torch.Tensor]:
    """The receive pool as `dspark plan` counts it, held through the steps: the streamers'
    credited buffers, each grown to the longest sample (the step's own sample is the one packed)."""
    streamers = cfg.cluster.verifier_nodes
    shares = -(-cfg.stream.buffer_per_trainer // streamers) * streamers
    tok = (len(cfg.verifier.aux_layer_ids) + 1) * cfg.verifier.hidden_size * DTYPE_BYTES[stream_dtype_name(cfg)]
    pool = BufferPool(dev, limit=shares)
    return [pool.take(cfg.data.max_seq_len * (tok + IDS_BYTES_PER_TOKEN)) for _ in range(shares)]
