"""What determines a toy build: `ToyConfig` (sizes, training recipe) and the architectures.

Its own module, so the builder (toy.py) and the training loop (toy_train.py) both import it
and neither imports the other.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hpc.errors import UserError

ARCHS = ("qwen3", "deepseek_v3")


@dataclass(frozen=True)
class ToyConfig:
    """Everything that determines a toy build; its hash names the cache entry."""

    arch: str = "qwen3"
    seed: int = 0
    steps: int = 300
    vocab_size: int = 3072
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 384
    # DeepseekV3 only. vLLM's CPU MLA path needs kv_lora_rank=512 and qk_rope_head_dim=64.
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    n_routed_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 96
    first_k_dense_replace: int = 1
    # Training.
    seq_len: int = 256
    batch_size: int = 8
    lr: float = 3e-3
    unlikelihood: float = 1.0  # weight of the anti-repetition term (toy_train.objective); 0 = plain LM
    unlikelihood_window: int = 48
    corpus_limit: int = 0  # first N exchanges only (0: all); keeps tiny test builds quick
    max_position_embeddings: int = 4096

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise UserError(f"toy arch {self.arch!r} unknown; choose one of {', '.join(ARCHS)}")

    @classmethod
    def preset(cls, arch: str, seed: int = 0, steps: int | None = None) -> ToyConfig:
        """The default build per arch; the DeepseekV3 toy only needs non-random hidden states."""
        # qwen3: ~3 min on 2 cores; at 400-800 steps (or without the unlikelihood term) greedy
        # replies still fell into loops on some eval prompts (toy-target --report).
        default_steps = {"qwen3": 1200, "deepseek_v3": 60}[arch] if arch in ARCHS else 0
        cfg = cls(arch=arch, seed=seed, steps=default_steps if steps is None else steps)
        if arch == "deepseek_v3":
            cfg = dataclasses.replace(cfg, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=256)
        return cfg

    @classmethod
    def tiny(cls, arch: str = "qwen3", seed: int = 0, steps: int = 4) -> ToyConfig:
        """A seconds-long build for tests of the build itself (determinism, caching)."""
        return dataclasses.replace(
            cls.preset(arch, seed, steps), vocab_size=512, hidden_size=64, num_layers=2,
            intermediate_size=128, seq_len=32, batch_size=2, corpus_limit=200,
        )
