"""Training reads the regenerated (on-policy) shards once they are complete."""

from __future__ import annotations

import json
from pathlib import Path

from hpc.config import load_config, to_object
from hpc.train.prepare import training_sources

ROOT = Path(__file__).resolve().parents[2]


def test_regenerated_shards_replace_the_sources_only_when_finished(tmp_path):
    src = tmp_path / "orig.jsonl"
    src.write_text("")
    cfg = to_object(load_config(ROOT / "configs" / "toy-cpu.yaml",
                                [f"data.sources=[{{path: {src}}}]", f"data.output_dir={tmp_path}"]))
    assert training_sources(cfg) == [(str(src), "train", None)]
    regen = tmp_path / "regenerated"
    regen.mkdir()
    (regen / "manifest.json").write_text(json.dumps({"finished": False, "shards": []}))
    assert training_sources(cfg) == [(str(src), "train", None)]  # half done: not yet
    (regen / "manifest.json").write_text(json.dumps({"finished": True, "shards": []}))
    assert training_sources(cfg) == [(str(regen), "train", None)]
    cfg.data.regenerate = False
    assert training_sources(cfg) == [(str(src), "train", None)]
