"""The target model as local files: what `verifier.model` names, resolved once, read by everyone.

`verifier.model` is a local directory or a hub id (`org/name`, pinned by `verifier.revision`).
A hub id resolves to a snapshot in the Hugging Face cache (`HF_HUB_CACHE`, on a filesystem
every node sees): safetensors weights, configs, tokenizer and remote code, never pickles. In
a Slurm job node 0 resolves it and the other nodes read the path it wrote (launch/node_setup.py);
the job's config then names the snapshot directory in `verifier.model` and keeps the hub id
in `verifier.name` for exports and baseline keys.

Offline mode is the user's: `verifier.offline` when set, else the environment's HF_HUB_OFFLINE.
`dspark validate` reads only what is already local (a directory or the cache): login nodes
often have no network.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from hpc.config.schema import DSparkConfig, VerifierConfig
from hpc.errors import UserError

# Weights as safetensors only (no pickles), plus what vLLM and tokenizers read.
SNAPSHOT_FILES = ["*.safetensors", "*.json", "*.py", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
_TRUE = ("1", "true", "yes", "on")


def offline_mode(offline: bool | None) -> bool:
    if offline is not None:
        return bool(offline)
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in _TRUE


def is_local(model: str) -> bool:
    """A directory, named as one: `org/name` is a hub id even where a directory of that name sits
    in the current directory (a co-user's `moonshotai/Kimi-K2.6/` there would shadow it);
    `./org/name` names the directory."""
    return not looks_like_hub_id(model) and Path(model).expanduser().is_dir()


def looks_like_hub_id(model: str) -> bool:
    """`org/name`: not an explicit path (/, ./, ../, ~) and two non-empty parts."""
    parts = model.split("/")
    return not model.startswith(("/", ".", "~")) and len(parts) == 2 and all(parts)


def resolve_target(model: str, revision: str | None = None, offline: bool | None = None,
                   files: list[str] | None = None, token: str | None = None) -> Path:
    """A local directory holding the target (or just `files` of it); one line naming the id if not."""
    if is_local(model):
        return Path(model).expanduser()
    if not looks_like_hub_id(model):
        raise UserError(f"verifier.model = {model!r}: no such directory, and not a hub id (org/name)")
    from huggingface_hub import snapshot_download  # huggingface_hub: loaded only on this path

    off = offline_mode(offline)
    try:
        path = snapshot_download(model, revision=revision, local_files_only=off, token=token,
                                 allow_patterns=files or SNAPSHOT_FILES,
                                 cache_dir=os.environ.get("HF_HUB_CACHE") or None)
    except Exception as err:  # noqa: BLE001 - offline miss, no such repo, gated, network: all one line
        at = f" at revision {revision}" if revision else ""
        why = str(err).splitlines()[0][:160] if str(err) else type(err).__name__
        hint = ("it is not in the local cache; download it first (`hf download " + model + "`) or set "
                "verifier.offline=false" if off else "check the id, the network and HF_TOKEN (verifier.env)")
        raise UserError(f"verifier.model = {model!r}{at}: cannot resolve the hub id ({why}); offline mode is "
                        f"{'on' if off else 'off'} (verifier.offline / HF_HUB_OFFLINE): {hint}") from None
    return Path(path)


def read_config_json(path: Path, model: str | Path) -> dict:
    """The target's config.json as a dict, or one line naming `verifier.model`: a download cut
    short leaves a truncated file, and every reader (validate, the backends, export) goes here."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        why = (f"{err.msg} (line {err.lineno} column {err.colno})" if isinstance(err, json.JSONDecodeError)
               else "not UTF-8")
        raise UserError(f"verifier.model = {str(model)!r}: {path} is not valid JSON (truncated?): {why}; download "
                        "the model again or point verifier.model at a complete HF model directory") from None
    if not isinstance(data, dict):
        raise UserError(f"verifier.model = {str(model)!r}: {path} holds a JSON {type(data).__name__}, not an "
                        "object; point verifier.model at an HF model directory")
    return data


def cached_config_dir(model: str, revision: str | None = None) -> Path | None:
    """Where the target's config.json is without any network: a directory or the HF cache; else None."""
    if is_local(model):
        return Path(model).expanduser()
    if not looks_like_hub_id(model):
        return None
    try:
        return resolve_target(model, revision, offline=True, files=["config.json"])
    except UserError:
        return None


def localized(verifier_cfg: VerifierConfig, path: Path) -> VerifierConfig:
    """The verifier section naming the local snapshot, with the hub id kept as its name."""
    if str(path) == verifier_cfg.model:
        return verifier_cfg
    return replace(verifier_cfg, model=str(path), name=verifier_cfg.name or verifier_cfg.model)


def localize(cfg: DSparkConfig) -> DSparkConfig:
    """`cfg` with its target resolved on this machine (a whole config; a copy when it changes)."""
    v = cfg.verifier
    if is_local(v.model):
        return cfg
    path = resolve_target(v.model, v.revision, v.offline, token=v.env.get("HF_TOKEN"))
    return replace(cfg, verifier=localized(v, path))


# The target's dims the config repeats (the draft's width follows verifier.hidden_size).
TARGET_DIMS = ("num_hidden_layers", "hidden_size", "vocab_size")


def written_keys(data: Mapping, prefix: str = "") -> set[str]:
    """Every dotted key a YAML mapping writes a value at."""
    out: set[str] = set()
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        out.add(full)
        if isinstance(value, Mapping):
            out |= written_keys(value, full)
    return out


def follow_target(cfg: Any, written: set[str]) -> None:
    """The target dims the user left out of `verifier` take the values of the target's own
    config.json when it is on this machine (a directory or the HF cache, never the network), so
    a recipe moves to another target by changing verifier.model alone. `cfg`: the DictConfig."""
    missing = [k for k in TARGET_DIMS if f"verifier.{k}" not in written]
    model = cfg.verifier.get("model") if missing else None
    if not isinstance(model, str) or not model:
        return
    try:
        where = cached_config_dir(model, cfg.verifier.get("revision"))
        if where is None or not (where / "config.json").is_file():
            return
        data = read_config_json(where / "config.json", model)
    except (UserError, OSError):
        return  # validate names an unreadable config.json in its own line
    text = data.get("text_config") or data
    for key in missing:
        value = text.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            cfg.verifier[key] = value
