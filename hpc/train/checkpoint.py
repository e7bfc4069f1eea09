"""Training checkpoints: everything needed to resume bit-exactly, with no pickle anywhere.

The layout of `step_00001234/`, what a whole checkpoint is and which one a resume takes are a
format (`hpc.formats.checkpoint_layout`); this writes and reads one. The directory is written as a hidden
temp dir, fsynced and renamed when complete. The next save sets the damaged ones aside
(`.step_X.damaged`), so the prune to `keep_checkpoints` counts only this run's own.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from hpc.formats.checkpoint_layout import MANIFEST, TrainState, checkpoint_problem, list_checkpoints, step_dir
from hpc.fsio import replace_dir


def _rank(group=None) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def _barrier(group=None) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=group)


def optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for idx, state in sd["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{idx}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{idx}.{key}"] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def restore_optimizer(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        idx, key = name.split(".", 1)
        state.setdefault(int(idx), {})[key] = value
    for name, value in meta["scalars"].items():
        idx, key = name.split(".", 1)
        state.setdefault(int(idx), {})[key] = value
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def rng_tensors(generator: torch.Generator | None) -> dict[str, torch.Tensor]:
    out = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"torch_cuda_{i}"] = s
    if generator is not None:
        out["anchor_generator"] = generator.get_state()
    return out


def restore_rng(tensors: dict[str, torch.Tensor], generator: torch.Generator | None) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    # By device number (as strings torch_cuda_10 sorts before torch_cuda_2), and only the devices
    # this node shows: a resume may see fewer GPUs than the run that saved.
    cuda = sorted((int(k.rsplit("_", 1)[1]), v) for k, v in tensors.items() if k.startswith("torch_cuda_"))
    if cuda and torch.cuda.is_available():
        for i, state in cuda[: torch.cuda.device_count()]:
            torch.cuda.set_rng_state(state, i)
    if generator is not None and "anchor_generator" in tensors:
        generator.set_state(tensors["anchor_generator"])


def _set_aside_newer(root: Path, final: Path) -> None:
    """Checkpoints newer than the one just written belong to a timeline this run left: its resume
    fell back past them because they were damaged. Left in place they would count against
    `keep_checkpoints` (the prune would delete the good ones and keep the damaged) and a later
    resume would try them first. Renamed, not deleted, so the damage can still be examined."""
    for path in list_checkpoints(root):
        if path.name > final.name:
            why = checkpoint_problem(path)
            aside = root / f".{path.name}.{'damaged' if why else 'superseded'}"
            shutil.rmtree(aside, ignore_errors=True)
            path.rename(aside)
            print(f"checkpoint {path.name} set aside as {aside.name}: "
                  f"{why or 'newer than the checkpoint this run resumed from'}", file=sys.stderr, flush=True)


def save_checkpoint(root: str | Path, model: torch.nn.Module, export_config: dict, opt: torch.optim.Optimizer,
                    state: TrainState, generator: torch.Generator | None, keep: int, group=None) -> Path:
    """Collective: every rank writes its RNG file; rank 0 writes the rest and renames."""
    root = Path(root)
    final = root / step_dir(state.step)
    # Every rank writes into it, so its name is one they all know; one job owns output_dir.
    tmp = root / f".{step_dir(state.step)}.tmp"
    rank = _rank(group)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a job that died mid-save
        tmp.mkdir(parents=True)
    _barrier(group)
    save_file(rng_tensors(generator), str(tmp / f"rank{rank}.safetensors"))
    if rank == 0:
        weights = {k: v.detach().float().cpu().contiguous() if v.is_floating_point() else v.cpu().contiguous()
                   for k, v in model.state_dict().items()}
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(export_config, indent=2) + "\n")
        opt_t, opt_meta = optimizer_tensors(opt)
        save_file(opt_t, str(tmp / "optimizer.safetensors"))
        (tmp / "optimizer.json").write_text(json.dumps(opt_meta))
        py_state = random.getstate()
        rng = [py_state[0], list(py_state[1]), py_state[2]]
        (tmp / "state.json").write_text(json.dumps({**asdict(state), "python_rng": rng}))
    _barrier(group)
    if rank == 0:
        sizes = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
        (tmp / MANIFEST).write_text(json.dumps(sizes, indent=1) + "\n")
        replace_dir(tmp, final)
        _set_aside_newer(root, final)
        for old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier(group)
    return final


def load_checkpoint(path: str | Path, model: torch.nn.Module, opt: torch.optim.Optimizer | None,
                    generator: torch.Generator | None, group=None) -> TrainState:
    path = Path(path)
    weights = load_file(str(path / "model.safetensors"))
    ref = model.state_dict()
    model.load_state_dict({k: v.to(ref[k].dtype) for k, v in weights.items()})
    if opt is not None:
        restore_optimizer(opt, load_file(str(path / "optimizer.safetensors")),
                          json.loads((path / "optimizer.json").read_text()))
    raw = json.loads((path / "state.json").read_text())
    py = raw.pop("python_rng")
    random.setstate((py[0], tuple(py[1]), py[2]))
    rank_file = path / f"rank{_rank(group)}.safetensors"
    if rank_file.exists():
        restore_rng(load_file(str(rank_file)), generator)
    return TrainState(**raw)
