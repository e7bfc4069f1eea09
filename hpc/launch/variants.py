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

from hpc.errors import UserError

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
