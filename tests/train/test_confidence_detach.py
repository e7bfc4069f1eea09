"""train.loss.confidence_detach: the confidence head learns beside the draft and costs it nothing.

With the head's loss detached from the backbone, DSpark's backbone must train exactly as the
Markov-only ablation's does at the same seed and budget: every weight outside the head equal
to the bit. Then DSpark's acceptance equals Markov-only's by construction, and the head is paid
for only by its own parameters."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from hpc_dev.offline import train_in_process
from hpc_dev.toy_data import write_toy_conversations
from tests.fixtures.recipes import resolve_recipe

ROOT = Path(__file__).resolve().parents[2]
MARKOV_ONLY = ["draft.enable_confidence_head=false", "draft.confidence_head_with_markov=false"]


def _weights(toy_target: Path, tmp: Path, name: str, extra: list[str]) -> dict[str, torch.Tensor]:
    data = write_toy_conversations(tmp / "train.jsonl", n=24, seed=3)
    cfg = resolve_recipe(ROOT / "configs" / "toy-cpu.yaml",
                         [f"verifier.model={toy_target}", f"data.sources=[{{path: {data}}}]",
                          f"train.output_dir={tmp / name}", "train.hold_out_every=0", "train.grad_clip=0.5",
                          "data.regenerate=false", "train.loss.confidence_detach=true", *extra])
    ckpt = train_in_process(cfg, steps=6)
    return load_file(str(ckpt / "model.safetensors"))


def test_a_detached_head_leaves_the_backbone_bit_identical_to_markov_only(toy_target, tmp_path):
    dspark = _weights(toy_target, tmp_path, "dspark", [])
    markov = _weights(toy_target, tmp_path, "markov", MARKOV_ONLY)
    head = {k for k in dspark if k.startswith("confidence_head.")}
    assert head and set(dspark) - head == set(markov)
    for name, w in markov.items():
        assert torch.equal(dspark[name], w), name  # grad clipping included: the head's norm is its own
    assert not torch.equal(dspark[min(head)], torch.zeros_like(dspark[min(head)]))
