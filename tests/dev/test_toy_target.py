"""The toy targets: deterministic, cached, with a usable tokenizer and a non-degenerate model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from hpc_dev import toy
from hpc_dev.toy import MASK, ToyConfig, build_info, build_toy_target

# Tests that build a model are slow (tiny ones in seconds; the session toys, through their
# fixtures, ~2 min cold); the report's arithmetic is a unit test of the fast suite.


def _tensors(path: Path) -> dict:
    return load_file(path / "model.safetensors")


@pytest.mark.slow
def test_same_seed_gives_identical_build(tmp_path):
    a = build_toy_target(config=ToyConfig.tiny(seed=3), cache_dir=tmp_path / "a")
    b = build_toy_target(config=ToyConfig.tiny(seed=3), cache_dir=tmp_path / "b")
    c = build_toy_target(config=ToyConfig.tiny(seed=4), cache_dir=tmp_path / "c")
    assert a.name == b.name  # same cache key
    ta, tb, tc = _tensors(a), _tensors(b), _tensors(c)
    assert ta.keys() == tb.keys()
    assert all(ta[k].equal(tb[k]) for k in ta), "same seed must give bit-identical weights"
    assert not all(ta[k].equal(tc[k]) for k in ta), "another seed must change the weights"
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    assert build_info(a)["final_loss"] == build_info(b)["final_loss"]
    assert not list(a.parent.glob("*.tmp*")), "no half-built entry left behind"


@pytest.mark.slow
def test_cache_hit_returns_without_rebuilding(tmp_path, monkeypatch):
    cfg = ToyConfig.tiny(seed=1)
    assert not toy.toy_target_built(config=cfg, cache_dir=tmp_path)  # what the demo announces a build by
    first = build_toy_target(config=cfg, cache_dir=tmp_path)
    assert toy.toy_target_built(config=cfg, cache_dir=tmp_path)

    def must_not_run(*args, **kwargs):
        raise AssertionError("cache hit rebuilt the toy target")

    monkeypatch.setattr(toy, "_build_into", must_not_run)
    again = build_toy_target(config=cfg, cache_dir=tmp_path)
    assert again == first
    copied = build_toy_target(tmp_path / "out", config=cfg, cache_dir=tmp_path)
    assert copied == tmp_path / "out" and (copied / "model.safetensors").is_file()
    assert not (copied / toy.READY).exists()


def test_only_safetensors_are_written(toy_target):
    names = {p.name for p in toy_target.iterdir()}
    assert "model.safetensors" in names
    assert not [n for n in names if n.endswith((".bin", ".pt", ".pth", ".pkl"))]


def test_mask_token_is_reserved(toy_target):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(toy_target)
    config = json.loads((toy_target / "config.json").read_text())
    assert tok.mask_token == MASK
    assert 0 <= tok.mask_token_id < config["vocab_size"]
    assert tok(MASK, add_special_tokens=False)["input_ids"] == [tok.mask_token_id]
    # Ordinary text (even text that spells the marker's pieces) never produces the mask id.
    from hpc_dev.toy_corpus import exchanges

    text = " ".join(a for _, a in exchanges(50)) + " <|mask |> mask <| |>"
    assert tok.mask_token_id not in tok(text, add_special_tokens=False)["input_ids"]
    assert len(tok) == config["vocab_size"]


def test_chat_template_renders(toy_target):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(toy_target)
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    full = tok.apply_chat_template(conv, tokenize=False)
    prompt = tok.apply_chat_template(conv[:1], tokenize=False, add_generation_prompt=True)
    assert full == "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>hello<|im_end|>"
    assert full.startswith(prompt) and prompt.endswith("<|im_assistant|>assistant<|im_middle|>")
    assert tok.eos_token == "<|im_end|>"
    gen = json.loads((toy_target / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.eos_token_id
    ids = tok.apply_chat_template(conv[:1], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tok.convert_tokens_to_ids("<|im_assistant|>") in ids


@pytest.fixture(scope="module")
def hf_toy(toy_target):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoTokenizer.from_pretrained(toy_target), AutoModelForCausalLM.from_pretrained(toy_target).eval()


def test_greedy_replies_on_the_eval_fixtures_do_not_loop(toy_target):
    # The issue-12 guard, on the session's toy (fixed seed 0): no reply repeats one token more
    # than 8 times in a row, and replies are mostly distinct tokens, not a cycle.
    from hpc_dev.toy_report import report

    r = report(toy_target, benchmarks=["gsm8k", "humaneval"])
    for name, b in r["benchmarks"].items():
        assert b["longest_run"] <= 8, (name, [o["text"] for o in b["outputs"]])
        assert b["distinct_median"] >= 0.4 and b["lookup_rate"] <= 0.4, (name, b)
    assert r["held_out_perplexity"] < 60
    assert build_info(toy_target)["final_loss"] < 5.5


def test_report_figures_by_hand():
    from hpc_dev.toy_report import longest_run, lookup_hits, lookup_prediction

    assert longest_run([1, 2, 2, 2, 3, 3]) == 3 and longest_run([]) == 0
    # After [5, 6, 7, 5, 6] the longest earlier match of a suffix is [5, 6] -> predicts 7.
    assert lookup_prediction([5, 6, 7, 5, 6]) == 7 and lookup_prediction([1, 2, 3]) is None
    # prompt [1, 2, 3], reply 1 2 3 4: "1" has no earlier "3 ->", then 2 and 3 are predicted, 4 is not.
    assert lookup_hits([1, 2, 3], [1, 2, 3, 4]) == 2


def test_cli_copies_cached_build(toy_target, tmp_path, capsys):
    from hpc_dev.dev_cli import main

    assert main(["toy-target", str(tmp_path / "out"), "--arch", "qwen3", "--report"]) == 0
    printed = capsys.readouterr().out
    assert "final loss" in printed and "greedy:" in printed
    assert "lookup hit" in printed and "goals (distinct >= 0.4" in printed
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (toy_target / "model.safetensors").read_bytes()


def test_deepseek_toy_has_the_shape_vllm_needs(toy_deepseek):
    config = json.loads((toy_deepseek / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"]) == (512, 64)
    assert (config["topk_method"], config["scoring_func"]) == ("noaux_tc", "sigmoid")
    assert config["num_hidden_layers"] > config["first_k_dense_replace"], "needs at least one MoE layer"
