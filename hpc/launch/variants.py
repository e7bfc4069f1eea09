"""A pipeline's frozen variant configs, and the private directories they live in.

`dspark submit` writes one YAML per sweep variant and submits jobs that read it later, maybe
hours later. In a group-writable project a colleague (or a stray script) could edit it in the
meantime, so the file's name carries the hash of its content, and every job checks it before
it reads a single key. The pipeline's directories are 0700: the pickled submitit calls and the
variant files are for our jobs only.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from hpc.errors import UserError

if TYPE_CHECKING:
    from hpc.config.schema import DSparkConfig

# What decides the text the regenerate stage writes: it runs once, for variant 0, so a sweep over
# these would train every other variant on data made with variant 0's values. (Its servers'
# sizing, verifier.gpu_memory_utilization and the like, changes no token.)
REGENERATE_KEYS = ("data.sources", "data.calibration_sources", "data.seed", "data.regen", "data.output_dir",
                   "data.regenerate", "verifier.model", "verifier.revision", "verifier.tokenizer", "verifier.dtype")

_VARIANT = re.compile(r"^variant-\d+-(?P<hash>[0-9a-f]{16})\.yaml$")


def content_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def variant_path(root: Path, index: int, text: str) -> Path:
    return root / f"variant-{index}-{content_hash(text.encode())}.yaml"


def check_variant_file(path: str | Path) -> None:
    """Refuse a variant file whose content no longer matches the hash in its name."""
    path = Path(path)
    m = _VARIANT.match(path.name)
    if m is None:  # a config given by hand (`dspark stage NAME my.yaml`): nothing was frozen
        return
    if content_hash(path.read_bytes()) != m["hash"]:
        raise UserError(f"{path} changed after it was submitted (its content no longer matches the hash in "
                        "its name); submit the pipeline again instead of editing a submitted variant")


def private_dir(path: Path) -> Path:
    """`path`, created if needed, readable and writable by its owner only."""
    path.mkdir(parents=True, exist_ok=True)
    if path.stat().st_uid == os.getuid():
        os.chmod(path, 0o700)
    return path


def check_sweep_shape(cfg: DSparkConfig, variants: list[tuple[list[str], DSparkConfig]]) -> None:
    """One clear line, before anything is written or submitted, when a sweep varies what the
    tasks of one array share: the pipeline's jobs (eval.num_speculative_tokens, the calibrate
    stage's switches), or what the single regenerate job generates. `variants`: (the variant's
    overrides, its resolved config)."""
    from hpc.launch.stage_table import jobs

    swept = sorted(cfg.sweep or {})
    if cfg.data.regenerate:
        for key in swept:
            if key.startswith(REGENERATE_KEYS):
                raise UserError(f"sweep.{key}: the regenerate stage runs once for every variant, with the first "
                                f"variant's {key}; submit one pipeline per value (dspark submit CONFIG {key}=VALUE)")
    base = [j.name for j in jobs(cfg)]
    for extra, vcfg in variants:
        names = [j.name for j in jobs(vcfg)]
        if names != base:
            raise UserError(f"sweep {' '.join(extra)}: changes the pipeline's jobs ({', '.join(base)} -> "
                            f"{', '.join(names)}), which the tasks of one array share; submit one pipeline "
                            "per value instead")
