"""The teacher is the target: for every architecture in the table, our logits from the captured
last hidden state (post-norm, and pre-norm through the family's final norm) equal the HF
forward's logits. Each case is a tiny random model built with transformers and saved as a
checkpoint, so the files path (`target_logits`) and the in-memory path (`loaded_target_head`)
are both checked against `model(...).logits`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from hpc.errors import UserError
from hpc.model.families import ARCHITECTURES, rule_problems
from hpc.model.teacher import LogitTransform, loaded_target_head, target_head, target_logits

V, H, LAYERS = 96, 32, 2
COMMON = dict(vocab_size=V, hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=64, max_position_embeddings=128, tie_word_embeddings=False)
DEEPSEEK = dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
                v_head_dim=8,
                head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16,
                first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True)

# architecture -> (config class, model class, extra config); the transforms are set far from
# neutral so that leaving one out fails by far more than the tolerance.
CASES = {
    "LlamaForCausalLM": ("LlamaConfig", "LlamaForCausalLM", {}),
    "MistralForCausalLM": ("MistralConfig", "MistralForCausalLM", {"head_dim": 8}),
    "Qwen2ForCausalLM": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "Qwen3ForCausalLM": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                            {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}),
    "DeepseekV3ForCausalLM": ("DeepseekV3Config", "DeepseekV3ForCausalLM", DEEPSEEK),
    "KimiK25ForConditionalGeneration": ("DeepseekV3Config", "DeepseekV3ForCausalLM", DEEPSEEK),  # wrapped below
    "GraniteForCausalLM": ("GraniteConfig", "GraniteForCausalLM", {"logits_scaling": 8.0}),
    "GraniteMoeForCausalLM": ("GraniteMoeConfig", "GraniteMoeForCausalLM",
                              {"logits_scaling": 6.0, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "Gemma2ForCausalLM": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 8, "final_logit_softcapping": 2.0}),
    "Gemma3ForCausalLM": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 8, "final_logit_softcapping": 1.5}),
    "CohereForCausalLM": ("CohereConfig", "CohereForCausalLM", {"logit_scale": 0.25}),
}
TRANSFORMED = {"GraniteForCausalLM", "GraniteMoeForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
               "CohereForCausalLM"}


def test_every_table_row_has_a_parity_case():
    assert set(CASES) == set(ARCHITECTURES)


def _build(arch: str, tmp: Path):
    cfg_cls, model_cls, extra = CASES[arch]
    torch.manual_seed(sorted(CASES).index(arch))
    config = getattr(transformers, cfg_cls)(**{**COMMON, **extra})
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # random init gives logits near 0, where a softcap or scale hides
        for p in model.parameters():
            p.normal_(0.0, 0.3)
        model.get_output_embeddings().weight.mul_(4.0)
    model.save_pretrained(tmp / arch, safe_serialization=True)
    if arch == "KimiK25ForConditionalGeneration":
        _wrap_like_kimi(tmp / arch)
    return model


def _wrap_like_kimi(path: Path) -> None:
    """Kimi-K2.6's layout: an outer multimodal config whose `text_config` is the DeepseekV3 one,
    and the language model's tensors under a `language_model.` prefix."""
    inner = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({"architectures": ["KimiK25ForConditionalGeneration"],
                                                  "model_type": "kimi_k25", "text_config": inner}))
    tensors = load_file(str(path / "model.safetensors"))
    save_file({f"language_model.{k}": v for k, v in tensors.items()}, str(path / "model.safetensors"))


def _hf(model, ids):
    """(HF logits, post-norm last hidden, pre-norm last hidden) for one sequence."""
    grabbed = {}
    hook = model.get_decoder().norm.register_forward_pre_hook(lambda _m, a: grabbed.setdefault("pre", a[0]))
    with torch.no_grad():
        out = model(input_ids=ids[None], output_hidden_states=True)
    hook.remove()
    return out.logits[0], out.hidden_states[-1][0], grabbed["pre"][0]


def _rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("arch", sorted(CASES))
def test_teacher_logits_equal_the_targets_own(arch, tmp_path):
    model = _build(arch, tmp_path)
    ids = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(1))
    ref, post, pre = _hf(model, ids)
    with torch.no_grad():
        assert _rel(target_logits(tmp_path / arch, post), ref) < 1e-5
        assert _rel(target_logits(tmp_path / arch, pre, pre_norm=True), ref) < 1e-5
        assert _rel(loaded_target_head(model)(post), ref) < 1e-5
        plain = post @ model.get_output_embeddings().weight.T
    # The case means something: where the family transforms its logits, lm_head alone is far off.
    assert (_rel(plain, ref) > 1e-2) == (arch in TRANSFORMED), _rel(plain, ref)


def test_draft_vocab_rows_are_the_full_logits_columns(tmp_path):
    # Training holds the head over the draft vocab only: the transform is elementwise, so it must
    # give exactly the full logits' kept columns (a softcap over a renormalised subset would not).
    model = _build("Gemma2ForCausalLM", tmp_path)
    _, post, _ = _hf(model, torch.arange(10))
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[::3] = True
    head = target_head(tmp_path / "Gemma2ForCausalLM", t2d)
    with torch.no_grad():
        assert torch.equal(head(post), target_logits(tmp_path / "Gemma2ForCausalLM", post)[:, t2d])


def test_an_architecture_outside_the_table_is_one_line(tmp_path):
    model = _build("LlamaForCausalLM", tmp_path)
    config = json.loads((tmp_path / "LlamaForCausalLM" / "config.json").read_text())
    config["architectures"] = ["PhiForCausalLM"]
    (tmp_path / "LlamaForCausalLM" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError) as err:
        target_head(tmp_path / "LlamaForCausalLM")
    line = str(err.value)
    assert "\n" not in line and "PhiForCausalLM" in line and "hpc/model/families.py" in line
    assert model is not None


def test_a_transform_the_row_does_not_apply_is_refused():
    # A Llama-class config carrying Gemma's soft-cap would be trained toward logits it never makes.
    problems = rule_problems(["LlamaForCausalLM"], {"final_logit_softcapping": 30.0})
    assert len(problems) == 1 and "final_logit_softcapping" in problems[0]
    assert rule_problems(["LlamaForCausalLM"], {"final_logit_softcapping": None, "logits_scaling": 1.0}) == []
    assert rule_problems(["GraniteForCausalLM"], {"logits_scaling": 0}) != []
    assert rule_problems(["Gemma2ForCausalLM"], {"final_logit_softcapping": None}) == []


def test_missing_keys_take_the_config_class_defaults():
    # transformers fills what config.json leaves out: Gemma 2 soft-caps at 30 by default, Cohere scales by 1/16.
    assert LogitTransform.of(["Gemma2ForCausalLM"], {}).softcap == 30.0
    assert LogitTransform.of(["Gemma3ForCausalLM"], {}).softcap is None
    assert LogitTransform.of(["CohereForCausalLM"], {}).multiply == 0.0625
    assert LogitTransform.of(["GraniteForCausalLM"], {}).divide == 1.0


def test_a_bias_in_the_checkpoint_is_applied(tmp_path):
    model = _build("LlamaForCausalLM", tmp_path)
    path = tmp_path / "LlamaForCausalLM" / "model.safetensors"
    tensors = load_file(str(path))
    bias = torch.randn(V, generator=torch.Generator().manual_seed(3))
    save_file({**tensors, "lm_head.bias": bias}, str(path))
    _, post, _ = _hf(model, torch.arange(10))
    with torch.no_grad():
        want = post @ tensors["lm_head.weight"].T + bias
    assert _rel(target_logits(path.parent, post), want) < 1e-5


def test_a_full_vocab_head_shares_the_models_lm_head(tmp_path):
    # At Kimi scale one lm_head is 2.3 GB: the reference engine's teacher must not hold a copy.
    model = _build("Qwen3ForCausalLM", tmp_path)
    head = loaded_target_head(model)
    weight = model.get_output_embeddings().weight
    assert head.draft_rows_DH.data_ptr() == weight.data_ptr()
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[:7] = True
    sub = target_head(tmp_path / "Qwen3ForCausalLM", t2d)
    assert sub.draft_rows_DH.shape == (7, weight.shape[1])
