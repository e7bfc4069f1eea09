"""The draft's settings and its loss's, held in one place each.

`DraftArgs` is the config's `draft:` section (hpc.config.schema), the argument of `DSparkDraft`,
and, through `to_config_json` / `from_config_json`, the `config.json` vLLM loads. `LossArgs` is
`train.loss:` and what the objective reads. Nothing here imports torch: the login node's
`validate` reads these classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hpc.errors import UserError


class ConfidenceTarget(str, Enum):
    # The event the confidence head learns to predict, which must be the event decoding runs on:
    # greedy = "the draft's argmax equals the target's"; sampling = the chance speculative
    # sampling keeps the draft, 1 - TV(p, q). Trained on one and used with the other, the
    # head is miscalibrated by construction (ECE 0.2-0.4 seen when greedy was scored on 1 - TV).
    greedy = "greedy"
    sampling = "sampling"


@dataclass
class DraftArgs:
    """The DSpark draft: a DFlash backbone of Qwen3 layers plus Markov and confidence heads.
    Defaults are Kimi-K2.6's; in a config the target's dims are interpolated from `verifier.*`."""

    num_hidden_layers: int = 3
    # The draft embeds tokens with the target's embed_tokens, so its width is the target's.
    hidden_size: int = 7168
    # 56 x 128 = 7168 = hidden: with these dims the draft is the card's 6.3 GB in bf16.
    num_attention_heads: int = 56
    num_key_value_heads: int = 8
    head_dim: int = 128
    intermediate_size: int = 18432
    rope_theta: float = 50000.0
    rms_norm_eps: float = 1e-6
    block_size: int = 8
    draft_vocab_size: int = 32000
    mask_token_id: int = 163608
    sample_from_anchor: bool = True
    markov_rank: int = 256  # 0 together with enable_confidence_head=false is plain DFlash
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    # The target's, which the draft reads: a config takes them from verifier.* (validate refuses
    # another value), an export from its config.json.
    target_hidden_size: int = 7168
    target_vocab_size: int = 163840
    aux_layer_ids: list[int] = field(default_factory=lambda: [1, 29, 57])
    # The positions vLLM sizes the draft's RoPE cache for: the target's, set from its config.json
    # when the draft is built (Kimi: 262144), this value only where that file names none; a
    # smaller one fails (CPU) or reads garbage (CUDA) on long contexts.
    max_position_embeddings: int = 32768

    @property
    def is_dflash(self) -> bool:
        return self.markov_rank == 0 and not self.enable_confidence_head

    @property
    def max_n(self) -> int:
        """Draft tokens one block holds: all B slots, or B - 1 when slot 0 is the bonus."""
        return self.block_size - (0 if self.sample_from_anchor else 1)

    def layer_config(self) -> dict[str, Any]:
        """A complete Qwen3 config: vLLM fills gaps with its own defaults (rope_theta 1e6)."""
        return {
            "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
            "hidden_size": self.hidden_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "intermediate_size": self.intermediate_size, "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "vocab_size": self.target_vocab_size, "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        }

    def to_config_json(self, verifier: str | None, verifier_arch: list[str], n: int) -> dict[str, Any]:
        """The speculators `config.json` vLLM loads, advertising `n` speculative tokens."""
        if not 1 <= n <= self.max_n:  # vLLM runs the advertised n when none is asked for: never a slot not trained
            raise UserError(f"speculative tokens n={n}: this draft proposes 1..{self.max_n} (block_size "
                            f"{self.block_size}{', slot 0 is the bonus' if not self.sample_from_anchor else ''}); "
                            f"pick n in that range")
        algo = "dflash" if self.is_dflash else "dspark"
        out: dict[str, Any] = {
            "speculators_model_type": algo,
            "architectures": ["DFlashDraftModel"] if self.is_dflash else ["Qwen3DSparkModel"],
            "transformer_layer_config": self.layer_config(),
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "block_size": self.block_size,
            "aux_hidden_state_layer_ids": list(self.aux_layer_ids),
            "mask_token_id": self.mask_token_id,
            # vLLM defaults this to False and speculators to True: never leave it implicit.
            "sample_from_anchor": self.sample_from_anchor,
            "torch_dtype": "bfloat16",
            "speculators_config": {
                "algorithm": algo,
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": n}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": verifier, "architectures": list(verifier_arch)},
            },
        }
        if self.is_dflash:
            out["dflash_config"] = {"mask_token_id": self.mask_token_id,
                                    "target_layer_ids": [i - 1 for i in self.aux_layer_ids],
                                    "sample_from_anchor": False}
        else:
            out.update({"markov_rank": self.markov_rank, "markov_head_type": self.markov_head_type,
                        "enable_confidence_head": self.enable_confidence_head,
                        "confidence_head_with_markov": self.confidence_head_with_markov})
        return out

    @classmethod
    def from_config_json(cls, cfg: dict[str, Any]) -> DraftArgs:
        """The draft an exported `config.json` describes (dspark or its dflash ablation)."""
        t = cfg["transformer_layer_config"]
        algo = cfg.get("speculators_model_type")
        if algo not in ("dspark", "dflash"):
            raise UserError(f"config.json has speculators_model_type={algo!r}; expected dspark or dflash")
        dflash = algo == "dflash"
        return cls(
            hidden_size=t["hidden_size"], num_hidden_layers=t["num_hidden_layers"],
            num_attention_heads=t["num_attention_heads"], num_key_value_heads=t["num_key_value_heads"],
            head_dim=t["head_dim"], intermediate_size=t["intermediate_size"], rope_theta=t["rope_theta"],
            rms_norm_eps=t["rms_norm_eps"], block_size=cfg["block_size"], draft_vocab_size=cfg["draft_vocab_size"],
            mask_token_id=cfg["mask_token_id"], sample_from_anchor=bool(cfg.get("sample_from_anchor", not dflash)),
            markov_rank=0 if dflash else cfg["markov_rank"], markov_head_type=cfg.get("markov_head_type", "vanilla"),
            enable_confidence_head=False if dflash else cfg.get("enable_confidence_head", False),
            confidence_head_with_markov=cfg.get("confidence_head_with_markov", True),
            target_hidden_size=cfg.get("target_hidden_size") or t["hidden_size"], target_vocab_size=t["vocab_size"],
            aux_layer_ids=list(cfg["aux_hidden_state_layer_ids"]),
            max_position_embeddings=int(t.get("max_position_embeddings", cls.max_position_embeddings)),
        )


@dataclass
class LossArgs:
    """The objective's weights (hpc.model.loss): per slot k, `ce_weight * CE + tv_weight * TV +
    kl_weight * KL`, weighed by exp(-k / decay_gamma), plus `confidence_weight * BCE`."""

    ce_weight: float = 0.1
    tv_weight: float = 0.9
    kl_weight: float = 0.0
    decay_gamma: float = 4.0  # slot k weighs exp(-k / gamma)
    confidence_weight: float = 1.0
    # sampling (1 - TV) is the published recipe. Training on greedy matches would calibrate the
    # head for greedy serving, but its loss, fed back through the shared backbone, cost the toy
    # draft acceptance at short budgets (1.36 -> 1.12 at 60 steps): opt in until that is solved.
    confidence_target: ConfidenceTarget = ConfidenceTarget.sampling
    # true: the confidence loss trains the head only. Fed back through the shared backbone it cost
    # the toy draft ~2% of tau@7 against Markov-only at equal budget (1.53 against 1.57); detached
    # (and clipped apart, hpc.train.trainer), the backbone trains bit for bit as Markov-only's does.
    confidence_detach: bool = True
