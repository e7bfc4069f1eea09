"""Read the few target tensors the trainer needs (lm_head, embed_tokens, final norm) straight
from the target's safetensors shards, without building a 1T-parameter model."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from hpc.errors import UserError

# Suffixes tried in order; multimodal checkpoints nest the LM (e.g. language_model.model.*).
ROLES = {
    "lm_head": ("lm_head.weight",),
    "embed_tokens": ("model.embed_tokens.weight", "embed_tokens.weight"),
    "norm": ("model.norm.weight", "norm.weight"),
    "lm_head_bias": ("lm_head.bias",),
}
OPTIONAL = ("lm_head_bias",)  # most heads have no bias; a missing one is not an error


def _index(model_dir: Path) -> dict[str, str]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise UserError(f"{model_dir}: no model.safetensors or model.safetensors.index.json (safetensors only)")
    with safe_open(str(single), "pt") as f:
        return {k: "model.safetensors" for k in f.keys()}


def load_target_tensors(model_dir: str | Path, roles=("lm_head", "embed_tokens", "norm")) -> dict[str, torch.Tensor]:
    model_dir = Path(model_dir)
    weight_map = _index(model_dir)
    out = {}
    for role in roles:
        name = next((n for suffix in ROLES[role] for n in weight_map if n == suffix or n.endswith("." + suffix)), None)
        if name is None:
            if role == "lm_head":  # tied embeddings: the head is the embedding
                name = next((n for s in ROLES["embed_tokens"] for n in weight_map if n.endswith(s)), None)
            if name is None and role in OPTIONAL:
                continue
            if name is None:
                raise UserError(f"{model_dir}: no tensor for {role} (looked for {', '.join(ROLES[role])})")
        with safe_open(str(model_dir / weight_map[name]), "pt") as f:
            out[role] = f.get_tensor(name)
    return out
