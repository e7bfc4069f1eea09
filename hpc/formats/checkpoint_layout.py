"""A training checkpoint's layout, what makes one whole, and which one a resume takes.

`step_00001234/` under train.output_dir/checkpoints:
- `model.safetensors` + `config.json`: the draft in the export layout (fp32), so
  `dspark export` reads a checkpoint directly;
- `optimizer.safetensors` + `optimizer.json`: optimizer tensors and hyper-parameters;
- `state.json`: step, epoch, data ledger (`TrainState`), python RNG state;
- `rank{r}.safetensors`: each rank's torch RNG states (CPU, CUDA, the anchor generator);
- `manifest.json`: every file's size, written last.

A resume checks the newest checkpoint (manifest sizes, JSON, safetensors headers) and falls back
to the previous good one, saying so: a node that died mid-write must not cost the run. The
trainer writes and reads the tensors (`hpc.train.checkpoint`); the data stage and the launcher
only ask which checkpoint is the latest.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

MANIFEST = "manifest.json"
REQUIRED = ("model.safetensors", "config.json", "optimizer.safetensors", "optimizer.json", "state.json")

STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir(step: int) -> str:
    return f"step_{step:08d}"


@dataclass
class TrainState:
    step: int = 0
    epoch: int = 0
    samples_seen: int = 0
    samples_skipped: int = 0  # reported by the streamers: their capture failed
    # [epoch, sample id] of every sample trained from `epoch` on: a restart skips them, so no
    # sample is seen twice. Pairs, not ids: near an epoch's end the samples in flight (and
    # those of one micro-step across ranks) mix two epochs, and the same id is due in both.
    ledger: list[list[int]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    data_hash: str = ""  # the prepared rows + vocabulary this state counts samples of

    def record(self, consumed: list[tuple[int, int]], epoch_size: int | None = None,
               skipped: Sequence[tuple[int, int]] = ()) -> None:
        """Add one micro-step's (epoch, id) pairs; drop each epoch once all of its samples are in.
        `skipped` samples failed to capture: they close their epoch like trained ones (or it would
        never close, and the ledger would grow all run), and a restart does not retry them."""
        self.ledger.extend([int(e), int(i)] for e, i in [*consumed, *skipped])
        self.samples_seen += len(consumed)
        self.samples_skipped += len(skipped)
        while epoch_size and sum(1 for e, _ in self.ledger if e == self.epoch) >= epoch_size:
            self.ledger = [p for p in self.ledger if p[0] != self.epoch]
            self.epoch += 1


def list_checkpoints(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)), key=lambda p: p.name)


def checkpoint_problem(path: Path) -> str | None:
    """Why `path` cannot be resumed from, or None when it is whole."""
    try:
        manifest = json.loads((path / MANIFEST).read_text()) if (path / MANIFEST).is_file() else {}
        for name in REQUIRED:
            if not (path / name).is_file():
                return f"{name} is missing"
        for name, size in manifest.items():
            if not (path / name).is_file() or (path / name).stat().st_size != size:
                return f"{name} is not the size the manifest records"
        from safetensors import safe_open  # its torch only when a checkpoint is checked, not at import

        for child in path.iterdir():
            if child.suffix == ".json":
                json.loads(child.read_text())
            elif child.suffix == ".safetensors":
                with safe_open(str(child), framework="pt") as f:
                    f.keys()
    except Exception as err:  # a damaged file raises whatever its parser raises
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return None


def latest_checkpoint(root: str | Path, say: Callable[[str], None] | None = None) -> Path | None:
    """The newest checkpoint that is whole; damaged newer ones are skipped, and `say` is told."""
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    found = list_checkpoints(Path(root))
    for i, path in enumerate(reversed(found)):
        why = checkpoint_problem(path)
        if why is None:
            return path
        earlier = found[-2 - i].name if i + 1 < len(found) else None
        say(f"checkpoint {path} is damaged ({why}); "
            + (f"falling back to {earlier}" if earlier else "no earlier checkpoint, starting from scratch"))
    return None
