"""Durable, atomic file and directory writes (stdlib only, so login-node code can use them).

A rename is atomic but not durable: after a power cut or a node crash the new name can point
at a file whose blocks never reached the disk. So the data is fsynced before the rename and
the parent directory after it. Temp names carry the pid and a random suffix: two writers of
one path (two jobs, two threads) never share or delete each other's temp file.
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path


def temp_name(path: Path, kind: str = "tmp") -> Path:
    """A hidden sibling of `path` that no other writer picks."""
    return path.with_name(f".{path.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Every file under `root`, then every directory, deepest first."""
    dirs = []
    for dirpath, _, files in os.walk(root):
        dirs.append(Path(dirpath))
        for name in files:
            fd = os.open(Path(dirpath) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for d in reversed(dirs):
        fsync_dir(d)


def write_bytes(path: str | Path, data: bytes, mode: int = 0o644) -> None:
    """Write `path` so that a reader sees the old content or the new, never a mix or a gap."""
    path = Path(path)
    tmp = temp_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_text(path: str | Path, text: str, mode: int = 0o644) -> None:
    write_bytes(path, text.encode("utf-8"), mode)


def replace_dir(tmp: Path, final: Path) -> None:
    """Move a complete directory `tmp` into place at `final`. The old `final` is renamed aside
    first and deleted only once the new one is in place, so at every instant `final` (or its
    aside copy) holds a whole directory."""
    fsync_tree(tmp)
    old = temp_name(final, "old") if final.exists() else None
    if old is not None:
        final.rename(old)
    tmp.rename(final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
