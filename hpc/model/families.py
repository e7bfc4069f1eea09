"""The target architectures we accept, and how each turns its last hidden state into logits.

The draft is trained toward the target's own next-token distribution, so the teacher must
apply whatever the target's forward applies after the decoder: its final norm (when the
capture delivers the pre-norm state), the lm_head (and its bias, if the checkpoint has one),
and the family's logit transform. `hpc.model.teacher` applies a rule; `validate` reads this
table on the login node, so it is plain data (no torch).

Facts from transformers' modelling files (5.x): Granite divides the logits by
`logits_scaling`; Gemma 2 and 3 soft-cap them, `cap * tanh(logits / cap)` with
`final_logit_softcapping`, and their RMSNorm scales by (1 + weight) in fp32; Cohere multiplies
them by `logit_scale`, after a mean-centred LayerNorm without bias. To add an architecture:
read its `*ForCausalLM.forward` after `self.model(...)` and its final norm, add a row here, and
add it to `tests/model/test_teacher.py`'s parity table.
"""

from __future__ import annotations

from dataclasses import dataclass

NORMS = ("rms", "rms_1p", "layernorm")


@dataclass(frozen=True)
class LogitRule:
    norm: str = "rms"  # rms: w * x/rms(x); rms_1p: (1 + w) * x/rms(x) in fp32 (Gemma); layernorm: Cohere's
    eps_key: str = "rms_norm_eps"
    multiply_key: str | None = None  # logits *= config[key] (Cohere's logit_scale)
    divide_key: str | None = None  # logits /= config[key] (Granite's logits_scaling)
    softcap_key: str | None = None  # logits = cap * tanh(logits / cap), cap = config[key] (Gemma 2/3)
    # What transformers' config class assumes when config.json leaves a key out.
    defaults: tuple[tuple[str, float | None], ...] = ()

    def value(self, config: dict, key: str) -> float | None:
        return config[key] if key in config else dict(self.defaults).get(key)


PLAIN = LogitRule()
GRANITE = LogitRule(divide_key="logits_scaling", defaults=(("logits_scaling", 1.0),))
GEMMA3 = LogitRule(norm="rms_1p", softcap_key="final_logit_softcapping")

# The outer `architectures[0]` of the target's config.json. Multimodal wrappers (Kimi-K2.5/2.6)
# nest the language model's config in `text_config`, which is where the rule's keys are read.
ARCHITECTURES: dict[str, LogitRule] = {
    "LlamaForCausalLM": PLAIN,
    "MistralForCausalLM": PLAIN,
    "Qwen2ForCausalLM": PLAIN,
    "Qwen3ForCausalLM": PLAIN,
    "Qwen3MoeForCausalLM": PLAIN,
    "DeepseekV3ForCausalLM": PLAIN,
    "KimiK25ForConditionalGeneration": PLAIN,  # DeepseekV3 text model (Kimi-K2.5/2.6)
    "GraniteForCausalLM": GRANITE,
    "GraniteMoeForCausalLM": GRANITE,
    "Gemma2ForCausalLM": LogitRule(norm="rms_1p", softcap_key="final_logit_softcapping",
                                   defaults=(("final_logit_softcapping", 30.0),)),
    "Gemma3ForCausalLM": GEMMA3,
    "CohereForCausalLM": LogitRule(norm="layernorm", eps_key="layer_norm_eps", multiply_key="logit_scale",
                                   defaults=(("logit_scale", 0.0625), ("layer_norm_eps", 1e-5))),
}

# Config keys that change the logits after the decoder in some family. A target whose config
# sets one that its row does not apply would be trained toward the wrong distribution.
TRANSFORM_KEYS = ("logits_scaling", "logit_scale", "final_logit_softcapping", "lm_head_multiplier",
                  "output_logits_scaling", "logits_multiplier")
_NEUTRAL = (None, 1, 1.0)


def rule_for(architectures: list[str] | tuple[str, ...]) -> LogitRule | None:
    return ARCHITECTURES.get(architectures[0]) if architectures else None


def applied_keys(rule: LogitRule) -> set[str]:
    return {k for k in (rule.multiply_key, rule.divide_key, rule.softcap_key) if k}


def rule_problems(architectures: list[str] | tuple[str, ...], text_config: dict) -> list[str]:
    """What keeps the teacher from reproducing this target's logits exactly, one line each
    (without the key prefix: the caller names `verifier.model`). Empty when it is exact."""
    rule = rule_for(architectures)
    if rule is None:
        arch = architectures[0] if architectures else "(none in config.json)"
        return [f"architecture {arch} is not in the logit-rule table hpc/model/families.py ARCHITECTURES "
                f"({', '.join(sorted(ARCHITECTURES))}); add a row for it (its final norm and logit transform, "
                "read from its transformers *ForCausalLM.forward) and a parity case in tests/model/test_teacher.py"]
    out = []
    for key in TRANSFORM_KEYS:
        if key not in applied_keys(rule) and text_config.get(key) not in _NEUTRAL:
            out.append(f"its config.json sets {key}={text_config[key]!r}, a logit transform the {architectures[0]} "
                       "row of hpc/model/families.py does not apply; add it to that row, or the draft trains "
                       "toward logits the target never produces")
    for key in sorted(applied_keys(rule)):
        value = rule.value(text_config, key)
        if key == rule.softcap_key and value is None:
            continue  # a Gemma without soft-capping: nothing to apply
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            out.append(f"its config.json has {key}={value!r}; the {architectures[0]} logit transform needs a "
                       "positive number there")
    return out
