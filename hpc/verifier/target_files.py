"""Small reads from a target's checkpoint: its text config and its final RMSNorm.

The vLLM backend needs the final norm's weight to turn vLLM's pre-norm capture into the
post-norm state the lm_head sees, without loading the model (Kimi-K2.6 is ~600 GB): only the
index and the one shard holding `...model.norm.weight` are read. Jobs hand us the local snapshot
(hpc.config.target); a hub id still resolves, one file at a time, through the same resolver.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, overload

import torch
from safetensors import safe_open

from hpc.config.target import read_config_json, resolve_target
from hpc.errors import UserError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@overload
def target_file(model: str | Path, name: str, *, required: Literal[True] = True) -> Path: ...
@overload
def target_file(model: str | Path, name: str, *, required: bool) -> Path | None: ...
def target_file(model: str | Path, name: str, *, required: bool = True) -> Path | None:
    """`name` inside a local model directory, or in the snapshot of a hub id (hpc.config.target)."""
    local = Path(model)
    root = local if local.is_dir() else resolve_target(str(model), files=[name])
    path = root / name
    if path.is_file():
        return path
    if required:
        raise UserError(f"{name} not found in {model}")
    return None


def text_config(model: str | Path) -> dict:
    """config.json, or its `text_config` for multimodal wrappers (Kimi-K2.5/2.6)."""
    cfg = read_config_json(target_file(model, "config.json"), model)
    return cfg.get("text_config") or cfg


def architectures(model: str | Path) -> list[str]:
    """The target's model classes (the outer config's, e.g. KimiK25ForConditionalGeneration):
    recorded in the export so vLLM and readers know which verifier the draft belongs to."""
    return list(read_config_json(target_file(model, "config.json"), model).get("architectures") or [])


def final_norm_weight(model: str | Path) -> torch.Tensor:
    """The decoder's final RMSNorm weight (`model.norm.weight`, maybe under a wrapper prefix)."""
    index = target_file(model, INDEX, required=False)
    if index is not None:
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        names = list(weight_map)
    else:
        with safe_open(target_file(model, SINGLE), framework="pt") as fh:
            names = list(fh.keys())
    # `model.norm.weight`, `language_model.model.norm.weight`, ...; MTP layers' norms
    # (`model.layers.61.shared_head.norm.weight`) do not end like this.
    found = sorted((n for n in names if n == "model.norm.weight" or n.endswith(".model.norm.weight")), key=len)
    if not found:
        raise UserError(f"no final norm (`model.norm.weight`) in the checkpoint of {model}")
    shard = target_file(model, weight_map[found[0]]) if index is not None else target_file(model, SINGLE)
    with safe_open(shard, framework="pt") as fh:
        return fh.get_tensor(found[0])
