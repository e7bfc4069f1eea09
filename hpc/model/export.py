"""The checkpoint vLLM serves: `config.json` (speculators format) + one `model.safetensors`.

A DSpark draft exports as `speculators_model_type: dspark` (Qwen3DSparkModel). Its DFlash
ablation (no Markov, no confidence head, DFlash slot layout) exports as `dflash`
(DFlashDraftModel), which vLLM on CPU can also decode. Weights are bf16; d2t int64, t2d bool.
Writes go to a temporary sibling directory renamed into place, so a reader never sees half
an export.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import cast

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hpc.errors import UserError
from hpc.formats.calibration import FILE as CALIBRATION
from hpc.formats.calibration import Calibration, Fold
from hpc.formats.draft_args import DraftArgs
from hpc.formats.vocab_map import check_d2t
from hpc.fsio import replace_dir
from hpc.model.dspark import DSparkDraft

WEIGHTS = "model.safetensors"
HEAD = ("confidence_head.proj.weight", "confidence_head.proj.bias")
# vLLM holds the confidence head in fp32 (qwen3_dspark.py), and a folded a*W rounded to bf16
# would no longer be the map that was fitted.
KEEP_DTYPE = {"d2t": torch.int64, "t2d": torch.bool, HEAD[0]: torch.float32, HEAD[1]: torch.float32}


def export_tensors(model: DSparkDraft) -> dict[str, torch.Tensor]:
    return {name: t.detach().to(KEEP_DTYPE.get(name, torch.bfloat16)).contiguous().cpu()
            for name, t in model.state_dict().items()}


def fold_head(tensors: dict[str, torch.Tensor], fold: Fold | None, inverse: bool = False) -> dict[str, torch.Tensor]:
    """`tensors` with the confidence head's weight W and bias c replaced by a W and a c + b (the
    map sigmoid(a z + b) on its logit z, folded), or, `inverse`, with that undone."""
    if fold is None or HEAD[0] not in tensors:
        return tensors
    w, c = tensors[HEAD[0]].double(), tensors[HEAD[1]].double()
    w, c = (w / fold.a, (c - fold.b) / fold.a) if inverse else (w * fold.a, c * fold.a + fold.b)
    return {**tensors, HEAD[0]: w.to(tensors[HEAD[0]].dtype), HEAD[1]: c.to(tensors[HEAD[1]].dtype)}


def head_sha256(tensors: dict[str, torch.Tensor]) -> str | None:
    """A hash of the confidence head as exported: binds a side file's maps to the head they read."""
    if HEAD[0] not in tensors:
        return None
    digest = hashlib.sha256()
    for name in HEAD:
        t = tensors[name].detach().to(torch.float32).contiguous().cpu()
        digest.update(f"{name}:{tuple(t.shape)};".encode())
        digest.update(t.numpy().tobytes())
    return digest.hexdigest()


def side_file_problem(path: str | Path) -> str | None:
    """Why the side file beside the export at `path` does not belong to its head, or None: read
    from two tensors of the safetensors, without loading the draft (a login-node check)."""
    path = Path(path)
    cal = Calibration.load(path)
    if cal is None or cal.head_sha256 is None:
        return None
    with safe_open(str(path / WEIGHTS), framework="pt") as f:
        if HEAD[0] not in f.keys():
            return f"{path / CALIBRATION}: the draft has no confidence head for its maps to read; delete the file"
        head = {name: f.get_tensor(name) for name in HEAD}
    if head_sha256(head) != cal.head_sha256:
        return (f"{path / CALIBRATION}: its maps were fitted for another confidence head than this export's "
                f"{WEIGHTS} (head_sha256 differs); re-run the calibration (dspark stage calibrate CONFIG) or "
                "delete the file")
    return None


def as_served(model: DSparkDraft) -> DSparkDraft:
    """A copy of `model` with the weights its export holds (rounded to bf16): what the eval and
    vLLM run, so what a calibration must be fitted on. The fp32 training weights move a
    position's Platt map by a few hundredths on the toy."""
    served = copy.deepcopy(model)
    exported = export_tensors(model)
    served.load_state_dict({k: exported[k].to(device=t.device, dtype=t.dtype) for k, t in model.state_dict().items()})
    return served


EXPORT_FILES = {"config.json", WEIGHTS}


def is_export(path: Path) -> bool:
    """A directory holding exactly a draft export, which `dspark export` may replace: its
    calibration (written by the calibrate stage) is part of it."""
    try:
        if path.is_symlink():
            return False
        entries = list(path.iterdir())
        # Plain files only: a link or a directory under an export's name is not one we wrote,
        # and replacing the export must not reach through it.
        if not all(p.is_file() and not p.is_symlink() for p in entries):
            return False
        return {p.name for p in entries} - {CALIBRATION} == EXPORT_FILES and \
            "speculators_model_type" in json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False


def check_export_target(out: Path) -> None:
    """OUT is replaced whole, so it must be new, empty, or an earlier export: anything else
    (a training run, a checkpoint directory, a home directory) is refused before any work."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise UserError(f"{out} exists and is not a directory; choose a new OUT directory")
    if out.is_dir() and any(out.iterdir()) and not is_export(out):
        raise UserError(f"{out} is not empty and not a draft export (only config.json + {WEIGHTS}); "
                        "export into a new directory, e.g. runs/train/export")


def atomic_dir(out: Path):
    """Context manager: a temp dir next to `out`, fsynced and renamed over it on success."""
    class _Atomic:
        def __enter__(self_inner) -> Path:
            check_export_target(out)
            out.parent.mkdir(parents=True, exist_ok=True)
            self_inner.tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
            return self_inner.tmp

        def __exit__(self_inner, exc_type, *_):
            if exc_type is not None:
                shutil.rmtree(self_inner.tmp, ignore_errors=True)
                return False
            check_export_target(out)  # it may have changed while the weights were written
            # mkdtemp makes it 0700, and safetensors writes 0600 whatever the umask: an export is
            # meant to be shared (served, evaluated and registered by other users' jobs).
            os.chmod(self_inner.tmp, 0o755)
            for f in self_inner.tmp.iterdir():
                os.chmod(f, 0o644)
            replace_dir(self_inner.tmp, out)
            return False
    return _Atomic()


def export_draft(model: DSparkDraft, out: str | Path, verifier: str | None = None,
                 verifier_arch: list[str] | None = None, n: int | None = None) -> Path:
    out = Path(out)
    a = model.args
    if a.is_dflash and a.sample_from_anchor:
        raise UserError("a DFlash export needs draft.sample_from_anchor=false (vLLM's dflash layout)")
    check_d2t(model.d2t, a.target_vocab_size)
    cfg = a.to_config_json(verifier, verifier_arch or [], a.max_n if n is None else n)
    # The model names them by what decoding asks of them; an export writes ours (their records).
    fold, calibration = cast("Fold | None", model.confidence_fold), cast("Calibration | None",
                                                                        model.confidence_calibration)
    tensors = fold_head(export_tensors(model), fold)
    if fold is not None and model.confidence_head is not None:
        # What vLLM serves is sigmoid of this head: say what was folded into it, and from what.
        cfg["confidence_fold"] = fold.record()
    with atomic_dir(out) as tmp:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        if calibration is not None:
            calibration.head_sha256 = head_sha256(tensors)
            calibration.save(tmp)
    return out


def refold_export(path: str | Path, fold: Fold | None, calibration: Calibration | None) -> Path:
    """Rewrite the export at `path`, atomically, with `fold` folded into its served head (None:
    the raw head) and `calibration` as its side file. The tensors are rewritten as stored, not
    through a model: at Kimi's size an fp32 copy of the draft would take 13 GB of host memory."""
    path = Path(path)
    cfg = read_export_config(path)
    tensors = load_file(str(path / WEIGHTS))
    if HEAD[0] not in tensors:
        raise UserError(f"{path}: the draft has no confidence head, so there is nothing to fold or calibrate")
    try:
        before = Fold.from_record(cfg["confidence_fold"]) if cfg.get("confidence_fold") is not None else None
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise UserError(f"{path / 'config.json'}: confidence_fold is damaged ({err}); re-export the draft") from None
    # From the raw head (whatever an earlier fold left in the file), in fp32 as vLLM holds it.
    tensors = {**tensors, **{name: tensors[name].float() for name in HEAD}}
    tensors = fold_head(fold_head(tensors, before, inverse=True), fold)
    cfg.pop("confidence_fold", None)
    if fold is not None:
        cfg["confidence_fold"] = fold.record()
    with atomic_dir(path) as tmp:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        if calibration is not None:
            calibration.head_sha256 = head_sha256(tensors)
            calibration.save(tmp)
    return path


def read_export_config(path: Path) -> dict:
    """config.json of an export or checkpoint; one line when it is missing, cut short or foreign."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file() or not (path / WEIGHTS).is_file():
        raise UserError(f"{path} is not a draft export: it needs config.json and {WEIGHTS}")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise UserError(f"{cfg_file}: not valid JSON ({err}); the file is damaged or truncated, "
                        "re-export it or pick an earlier checkpoint") from None
    if not isinstance(cfg, dict) or "transformer_layer_config" not in cfg:
        raise UserError(f"{cfg_file}: not a speculators draft config (no transformer_layer_config)")
    return cfg


def load_draft(path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> DSparkDraft:
    """An export (or a checkpoint in the same layout) back into a model, shapes checked by name."""
    path = Path(path)
    weights = path / WEIGHTS
    cfg = read_export_config(path)
    try:
        model = DSparkDraft(DraftArgs.from_config_json(cfg))
    except KeyError as err:
        raise UserError(f"{path / 'config.json'}: missing key {err}; the file is damaged, re-export the draft") from None
    try:
        tensors = load_file(str(weights))
    except Exception as err:  # safetensors raises its own error type for a cut-short file
        raise UserError(f"{weights}: unreadable ({str(err).splitlines()[0]}); the file is damaged or truncated, "
                        "re-export it or pick an earlier checkpoint") from None
    expected = model.state_dict()
    problems = [f"{k}: missing from {weights.name}" for k in expected if k not in tensors]
    problems += [f"{k}: unexpected tensor (not in the config's model)" for k in tensors if k not in expected]
    problems += [f"{k}: shape {tuple(tensors[k].shape)} in the file, config says {tuple(v.shape)}"
                 for k, v in expected.items() if k in tensors and tensors[k].shape != v.shape]
    if problems:
        raise UserError(f"{path} does not match its config.json: " + "; ".join(problems[:5]))
    check_d2t(tensors["d2t"].long(), model.args.target_vocab_size)
    calibration = Calibration.load(path)
    if calibration is not None and calibration.head_sha256 not in (None, head_sha256(tensors)):
        raise UserError(side_file_problem(path) or f"{path / CALIBRATION}: fitted for another confidence head")
    fold = None
    if cfg.get("confidence_fold") is not None and model.confidence_head is not None:
        try:
            fold = Fold.from_record(cfg["confidence_fold"])
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise UserError(f"{path / 'config.json'}: confidence_fold is damaged ({err}); re-export the draft") from None
    # In memory the head is the raw one training made: vLLM's is rebuilt from it on export.
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in fold_head(tensors, fold, inverse=True).items()})
    model.confidence_calibration, model.confidence_fold = calibration, fold
    return model.to(device=device, dtype=dtype) if dtype != torch.float32 or device != "cpu" else model


def shapes_only_inventory(args: DraftArgs) -> list[tuple[str, tuple[int, ...], torch.dtype, int]]:
    """(name, shape, export dtype, bytes) for every exported tensor, built on the meta device."""
    with torch.device("meta"):
        model = DSparkDraft(args)
    rows = []
    for name, t in model.state_dict().items():
        dtype = KEEP_DTYPE.get(name, torch.bfloat16)
        rows.append((name, tuple(t.shape), dtype, t.numel() * torch.empty((), dtype=dtype).element_size()))
    return rows
