"""Warm start: a fresh training run begins from an earlier draft's weights (`train.init_from`).

The source is a draft export directory (config.json + model.safetensors) or `champion`, the
registry's champion of `tracking.registered_model`, downloaded from MLflow. Tensors are copied
by name. The draft vocabulary is not: it belongs to the data this run prepared (the verifier
head uses it), so rows indexed by draft id are moved to wherever their target token sits now.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from hpc.config.schema import DSparkConfig, TrackingConfig
from hpc.config.secrets import redact_uri, scrub
from hpc.errors import UserError
from hpc.formats.vocab_map import selected_from_d2t
from hpc.model.dspark import DSparkDraft

CHAMPION = "champion"
VOCAB = ("d2t", "t2d")  # this run's mapping, from this run's data
VOCAB_ROWS = ("lm_head.weight", "markov_head.markov_w2.weight")  # row j = draft id j


def champion_export(tracking: TrackingConfig, dst: str | Path) -> tuple[Path, str]:
    """Download the champion's export into `dst`; (its directory, 'name vN')."""
    import mlflow.artifacts  # mlflow: loaded only on this path
    from mlflow.exceptions import MlflowException  # mlflow: loaded only on this path
    from mlflow.tracking import MlflowClient  # mlflow: loaded only on this path

    name = tracking.registered_model
    try:
        version = MlflowClient(tracking.uri).get_model_version_by_alias(name, CHAMPION)
    except MlflowException as err:
        raise UserError(f"train.init_from = 'champion': registered model {name!r} has no champion at "
                        f"{redact_uri(tracking.uri)} ({scrub(str(err).splitlines()[0])[:160]}); unset train.init_from "
                        "or point it at a draft export directory") from err
    path = mlflow.artifacts.download_artifacts(artifact_uri=version.source, dst_path=str(dst),
                                               tracking_uri=tracking.uri)
    return Path(path), f"{name} v{version.version}"


def _remap_rows(new: torch.Tensor, old: torch.Tensor, new_ids: torch.Tensor, old_ids: torch.Tensor) -> torch.Tensor:
    """Rows of `old` (indexed by the source's draft ids) at this run's draft ids, by target token;
    tokens the source never had keep this run's initial row."""
    where = torch.full((int(max(new_ids.max(), old_ids.max())) + 1,), -1, dtype=torch.int64)
    where[old_ids] = torch.arange(old_ids.numel())
    src = where[new_ids]
    out = new.detach().clone()
    hit = src >= 0
    out[hit] = old[src[hit]].to(out.dtype)
    return out


def copy_weights(model: DSparkDraft, source: DSparkDraft, what: str) -> int:
    """Copy `source`'s tensors into `model` by name; returns how many. A shape mismatch is an error."""
    mine, theirs = model.state_dict(), source.state_dict()
    new_ids, old_ids = selected_from_d2t(mine["d2t"]), selected_from_d2t(theirs["d2t"])
    same_vocab = torch.equal(new_ids, old_ids)
    copied = 0
    with torch.no_grad():
        for name, t in mine.items():
            if name in VOCAB or name not in theirs:
                continue
            src = theirs[name]
            if name in VOCAB_ROWS and not same_vocab and src.shape[1:] == t.shape[1:]:
                src = _remap_rows(t, src, new_ids, old_ids)
            elif src.shape != t.shape:
                raise UserError(f"train.init_from = {what!r}: {name} has shape {tuple(src.shape)} there but "
                                f"{tuple(t.shape)} in this draft; warm-start from a draft with the same "
                                "draft.* and verifier.* dims, or unset train.init_from")
            t.copy_(src.to(t.dtype))
            copied += 1
    return copied


def warm_start(model: DSparkDraft, cfg: DSparkConfig) -> str | None:
    """Load `cfg.train.init_from` into `model` (in place); a one-line account, or None if unset."""
    from hpc.model.export import load_draft  # safetensors: loaded only on this path

    what = cfg.train.init_from
    if not what:
        return None
    with tempfile.TemporaryDirectory(prefix="dspark-warm-start-") as tmp:
        if what == CHAMPION:
            path, label = champion_export(cfg.tracking, tmp)
        else:
            path, label = Path(what).expanduser(), what
            if not (path / "config.json").is_file():
                raise UserError(f"train.init_from = {what!r}: not a draft export directory (config.json + "
                                "model.safetensors); point it at an export or use champion")
        n = copy_weights(model, load_draft(path), what)
    line = f"warm start: {n} tensors from {label}"
    print(line, flush=True)
    return line
