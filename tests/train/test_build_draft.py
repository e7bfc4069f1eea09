"""The draft built for a target takes what it must match from the target's own files."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from hpc.formats.vocab_map import mapping_from_selected


def test_the_draft_takes_the_targets_context_length_into_its_export(tmp_path):
    """Kimi serves 262144 positions; the draft's export said 32768, so vLLM's RoPE cache for it
    was too small for a long context."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from hpc.train.trainer import build_draft
    from tests.fixtures.draft import toy_draft_args

    V, H = 96, 32
    torch.manual_seed(0)
    target = tmp_path / "target"
    Qwen3ForCausalLM(Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
                                 max_position_embeddings=131072)).save_pretrained(target, safe_serialization=True)
    d2t, t2d = mapping_from_selected(torch.arange(64), V)
    save_file({"d2t": d2t, "t2d": t2d}, str(tmp_path / "vocab.safetensors"))
    args = toy_draft_args(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
                      block_size=4, draft_vocab_size=64, mask_token_id=V - 1, target_hidden_size=H,
                      target_vocab_size=V, aux_layer_ids=[0, 1])
    model, _ = build_draft(args, str(target), tmp_path / "vocab.safetensors", norm=True)
    assert args.max_position_embeddings == 32768  # the caller's args are left alone
    cfg = model.args.to_config_json(None, [], model.args.max_n)
    assert cfg["transformer_layer_config"]["max_position_embeddings"] == 131072
    assert json.loads((target / "config.json").read_text())["max_position_embeddings"] == 131072
