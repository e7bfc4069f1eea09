"""The draft vocabulary's map, as `data/vocab.safetensors` holds it and vLLM loads it beside a draft.

The speculators / vLLM convention: `d2t[i] = selected[i] - i` (target_id = i + d2t[i]), int64 over
the draft's D ids, and `t2d` a bool mask over the target's V ids. The data stage writes the map
(`hpc.data.vocab` picks the ids), the trainer and the export read it. torch is imported where a
tensor is made or read, not at import: the login node imports this package.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from hpc.errors import UserError
from hpc.fsio import atomic_path

if TYPE_CHECKING:
    import torch

FILE = "vocab.safetensors"  # under train.output_dir/data/: d2t, t2d and the assistant-token counts


def save_vocab(path: str | Path, d2t: torch.Tensor, t2d: torch.Tensor, counts: torch.Tensor) -> Path:
    from safetensors.torch import save_file  # torch: only where a map is written

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        save_file({"d2t": d2t, "t2d": t2d, "counts": counts}, str(tmp))
    return path


def mapping_from_selected(selected_D: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [D] int64 offsets, t2d [V] bool) for ascending kept ids."""
    import torch  # only where a map is made

    selected_D = selected_D.long()
    check_selected(selected_D, vocab_size)
    d2t_D = selected_D - torch.arange(selected_D.numel(), dtype=torch.int64)
    t2d_V = torch.zeros(vocab_size, dtype=torch.bool)
    t2d_V[selected_D] = True
    return d2t_D, t2d_V


def selected_from_d2t(d2t_D: torch.Tensor) -> torch.Tensor:
    import torch  # only where a map is read

    return torch.arange(d2t_D.numel(), dtype=torch.int64) + d2t_D.long()


def check_selected(selected_D: torch.Tensor, vocab_size: int) -> None:
    if selected_D.numel() == 0:
        raise UserError("empty draft vocabulary")
    if int(selected_D.min()) < 0 or int(selected_D.max()) >= vocab_size:
        raise UserError(
            f"d2t maps draft ids to target ids {int(selected_D.min())}..{int(selected_D.max())}, "
            f"outside the target vocab 0..{vocab_size - 1}; rebuild the vocab for this target"
        )
    if selected_D.numel() > 1 and not bool((selected_D[1:] > selected_D[:-1]).all()):
        raise UserError("d2t does not map to strictly increasing target ids; rebuild the vocab")


def check_d2t(d2t_D: torch.Tensor, vocab_size: int) -> None:
    """A d2t loaded from disk must map into the target vocab, one-to-one."""
    import torch  # only where a map is read

    if d2t_D.dtype != torch.int64:
        raise UserError(f"d2t must be int64, got {d2t_D.dtype}")
    check_selected(selected_from_d2t(d2t_D), vocab_size)
