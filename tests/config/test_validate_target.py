"""Moving a recipe to another target: one `validate` names every shape mismatch with the values
that fix them all, the target's dims follow its config.json when left out, and a target whose
logits the teacher cannot reproduce is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc.config import ConfigError, load_config, to_object
from tests.fixtures.recipes import resolve_recipe

ROOT = Path(__file__).resolve().parents[2]
KIMI = ROOT / "configs" / "kimi-k2.6-dspark.yaml"


def _target(tmp_path: Path, arch: str = "GraniteForCausalLM", **extra) -> Path:
    """A target directory as far as validate reads it: its config.json."""
    path = tmp_path / "granite"
    path.mkdir(exist_ok=True)
    config = {"architectures": [arch], "model_type": "granite", "num_hidden_layers": 6, "hidden_size": 256,
              "vocab_size": 200000, "rms_norm_eps": 1e-6, "logits_scaling": 8.0, **extra}
    (path / "config.json").write_text(json.dumps(config))
    return path


def _problems(overrides: list[str], path: Path = KIMI) -> list[str]:
    with pytest.raises(ConfigError) as info:
        resolve_recipe(path, overrides)
    assert all("\n" not in p for p in info.value.problems)
    return info.value.problems


def test_one_run_names_every_shape_mismatch_and_the_overrides_that_fix_them_all(tmp_path):
    target = _target(tmp_path)
    problems = _problems([f"verifier.model={target}", "verifier.aux_layer_ids=[1,3,5]"])
    keys = [p.split(" = ")[0] for p in problems]
    # Kimi's recipe on a 256-wide, 6-layer target: the configured dims, the draft's width (it
    # follows verifier.hidden_size) and its heads (56 x 128) are all off, all in this one run.
    for key in ("verifier.num_hidden_layers", "verifier.hidden_size", "draft.hidden_size",
                "draft.num_attention_heads"):
        assert key in keys, problems
    heads = next(p for p in problems if p.startswith("draft.num_attention_heads"))
    assert "56 x 128 = 7168 != the target hidden size 256" in heads and "draft.num_attention_heads=2" in heads
    summary = [p for p in problems if p.startswith("target shape")]
    assert len(summary) == 1, problems
    fix = summary[0].split("at once: ")[1].split()
    assert {"verifier.num_hidden_layers=6", "verifier.hidden_size=256", "draft.hidden_size=256",
            "draft.num_attention_heads=2"} <= set(fix)
    # The fixes are enough: applied together, the recipe validates on this target.
    cfg = resolve_recipe(KIMI, [f"verifier.model={target}", "verifier.aux_layer_ids=[1,3,5]", *fix])
    assert (cfg.draft.hidden_size, cfg.draft.num_attention_heads * cfg.draft.head_dim) == (256, 256)


def test_left_out_target_dims_follow_the_targets_config_json(tmp_path):
    target = _target(tmp_path)
    cfg = to_object(load_config(None, [f"verifier.model={target}"]))
    assert (cfg.verifier.num_hidden_layers, cfg.verifier.hidden_size, cfg.verifier.vocab_size) == (6, 256, 200000)
    assert cfg.draft.hidden_size == 256  # the draft's width follows the target's
    # What the user wrote wins, and validate then names the disagreement.
    cfg = to_object(load_config(None, [f"verifier.model={target}", "verifier.hidden_size=128"]))
    assert cfg.verifier.hidden_size == 128 and cfg.verifier.num_hidden_layers == 6


def test_an_architecture_outside_the_table_is_one_line_naming_the_table(tmp_path):
    target = _target(tmp_path, arch="PhiForCausalLM")
    line = [p for p in _problems([f"verifier.model={target}"]) if "PhiForCausalLM" in p]
    assert len(line) == 1 and line[0].startswith("verifier.model = ")
    assert "hpc/model/families.py" in line[0] and "add a row" in line[0]


def test_a_logit_transform_the_table_does_not_know_is_one_line(tmp_path):
    target = _target(tmp_path, arch="LlamaForCausalLM", logits_scaling=1.0, final_logit_softcapping=30.0)
    line = [p for p in _problems([f"verifier.model={target}"]) if "final_logit_softcapping" in p]
    assert len(line) == 1 and "LlamaForCausalLM" in line[0]
    ok = _target(tmp_path, arch="LlamaForCausalLM", logits_scaling=1.0)  # neutral: nothing to apply
    assert not [p for p in _problems([f"verifier.model={ok}"]) if "logit transform" in p]


def test_aux_ids_past_the_targets_depth_are_one_line(tmp_path):
    target = _target(tmp_path)
    line = [p for p in _problems([f"verifier.model={target}"]) if p.startswith("verifier.aux_layer_ids")]
    assert len(line) == 1 and "id 29 outside 0..6" in line[0]
