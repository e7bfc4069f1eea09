"""configs/toy-cpu.yaml matches the real toy target it points at."""

from __future__ import annotations

import json
from pathlib import Path

from hpc_dev.toy_data import write_toy_conversations
from tests.fixtures.recipes import resolve_recipe

ROOT = Path(__file__).resolve().parents[2]


def test_toy_config_validates_against_the_built_toy(toy_target, tmp_path):
    data = write_toy_conversations(tmp_path / "train.jsonl", n=8)
    cfg = resolve_recipe(ROOT / "configs" / "toy-cpu.yaml",
                         [f"verifier.model={toy_target}", f"data.sources=[{{path: {data}}}]"])
    real = json.loads((Path(toy_target) / "config.json").read_text())
    assert (cfg.verifier.num_hidden_layers, cfg.verifier.hidden_size, cfg.verifier.vocab_size) == (
        real["num_hidden_layers"], real["hidden_size"], real["vocab_size"])
    tok = json.loads((Path(toy_target) / "tokenizer.json").read_text())
    mask = next(t for t in tok["added_tokens"] if t["content"] == "<|mask|>")
    assert cfg.draft.mask_token_id == mask["id"]
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert len(rows) == 8 and all(r["conversations"][1]["from"] == "gpt" for r in rows)
