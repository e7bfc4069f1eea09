"""The draft's tensors by name and shape, from the config alone: no torch.

`dspark plan` sizes memory and FLOPs from these on a login node, where importing torch costs
a second and may not be installed at all. `DSparkDraft` is the truth; tests/model/
test_inventory.py holds this table to its meta-device state_dict over the draft layouts
(DSpark, DFlash, Markov-only, the confidence head with and without the Markov input).
"""

from __future__ import annotations

from hpc.config.schema import DSparkConfig

# Bytes per element of the two buffers: d2t is int64 (draft id -> target id), t2d bool.
BUFFER_ITEMSIZE = {"d2t": 8, "t2d": 1}


def draft_shapes(cfg: DSparkConfig) -> dict[str, tuple[int, ...]]:
    d, v = cfg.draft, cfg.verifier
    H, V, D, hd = d.hidden_size, v.vocab_size, d.draft_vocab_size, d.head_dim
    out: dict[str, tuple[int, ...]] = {"d2t": (D,), "t2d": (V,), "embed_tokens.weight": (V, H),
                                       "fc.weight": (H, len(v.aux_layer_ids) * v.hidden_size),
                                       "hidden_norm.weight": (H,)}
    for i in range(d.num_hidden_layers):
        p = f"layers.{i}."
        out.update({
            p + "self_attn.q_proj.weight": (d.num_attention_heads * hd, H),
            p + "self_attn.k_proj.weight": (d.num_key_value_heads * hd, H),
            p + "self_attn.v_proj.weight": (d.num_key_value_heads * hd, H),
            p + "self_attn.o_proj.weight": (H, d.num_attention_heads * hd),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (d.intermediate_size, H), p + "mlp.up_proj.weight": (d.intermediate_size, H),
            p + "mlp.down_proj.weight": (H, d.intermediate_size),
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
        })
    out.update({"norm.weight": (H,), "lm_head.weight": (D, H)})
    if d.markov_rank:
        out.update({"markov_head.markov_w1.weight": (V, d.markov_rank),
                    "markov_head.markov_w2.weight": (D, d.markov_rank)})
    if d.enable_confidence_head:
        width = H + (d.markov_rank if d.confidence_head_with_markov and d.markov_rank > 0 else 0)
        out.update({"confidence_head.proj.weight": (1, width), "confidence_head.proj.bias": (1,)})
    return out
