"""Durable, atomic file and directory writes (stdlib only, so login-node code can use them).

A rename is atomic but not durable: after a power cut or a node crash the new name can point
at a file whose blocks never reached the disk. So the data is fsynced before the rename and
the parent directory after it. Temp names carry the pid and a random suffix: two writers of
one path (two jobs, two threads) never share or delete each other's temp file.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_TEMP = re.compile(r"^\..+\.(?:tmp|old)-(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{8}$")


def temp_name(path: Path, kind: str = "tmp") -> Path:
    """A hidden sibling of `path` that no other writer picks. It names its writer (host, pid),
    so a cleanup can tell a dead writer's leftovers from a live writer's file in progress."""
    return path.with_name(f".{path.name}.{kind}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(root: Path, max_age_s: float = 86400.0) -> list[Path]:
    """Delete the temp files in `root` whose writer is gone: a dead pid on this host, or (for
    another host, which we cannot ask) older than `max_age_s`. Live writers' files stay."""
    removed = []
    here = socket.gethostname()
    for path in root.glob(".*"):
        m = _TEMP.match(path.name)
        if m is None:
            continue
        if m["host"] == here:
            stale = not _alive(int(m["pid"]))
        else:
            stale = time.time() - path.lstat().st_mtime > max_age_s
        if stale:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path)
    return removed


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


@contextmanager
def atomic_path(path: str | Path, exclusive: bool = False) -> Iterator[Path]:
    """A temp path to write `path` through (for writers that take a file name: safetensors,
    matplotlib); on success it is fsynced and renamed over `path`, on failure removed. With
    `exclusive`, `path` is created but never replaced: FileExistsError if it exists (a hard link
    checks and creates in one step, so of two writers exactly one wins)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(path)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if exclusive:
            os.link(tmp, path)
            tmp.unlink()
        else:
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_bytes(path: str | Path, data: bytes, mode: int = 0o644, exclusive: bool = False) -> None:
    """Write `path` so that a reader sees the old content or the new, never a mix or a gap;
    `exclusive`: see atomic_path."""
    with atomic_path(path, exclusive) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)


def write_text(path: str | Path, text: str, mode: int = 0o644, exclusive: bool = False) -> None:
    write_bytes(path, text.encode("utf-8"), mode, exclusive)


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


def unsafe_ancestor(path: str | Path) -> str | None:
    """Why another user could swap `path` (or what it will hold) from under us, or None: a
    directory on its way from / that is not root's or ours, or that others may write without
    the sticky bit (they may rename what is in it, ours too). Only existing directories count."""
    me = os.geteuid()
    for d in [*reversed(Path(os.path.abspath(path)).parents), Path(os.path.abspath(path))]:
        try:
            st = os.stat(d)  # a link on the way is judged by where it points, as the kernel walks it
        except FileNotFoundError:
            break
        if not stat.S_ISDIR(st.st_mode):
            return f"{d} is not a directory"
        if st.st_uid not in (0, me):
            return f"{d} belongs to uid {st.st_uid}, who can replace what is under it"
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return f"{d} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}) without the sticky bit"
    return None


def untrusted(path: str | Path) -> str | None:
    """Why a file a command acts on (a pipeline.json it sends credentials for, a marker) cannot be
    trusted, or None: it and its directory must be this user's, the file a plain one nobody else
    may write, neither a link (another user could point it, or swap it, at their own)."""
    path = Path(path)
    me = os.geteuid()
    for p, what in ((path.parent, "directory"), (path, "file")):
        try:
            st = os.lstat(p)
        except OSError as err:
            return f"{p}: {err.strerror}"
        if stat.S_ISLNK(st.st_mode):
            return f"{p} is a symbolic link"
        if st.st_uid != me:
            return f"{p} belongs to uid {st.st_uid}, not to you (uid {me})"
        if what == "file" and not stat.S_ISREG(st.st_mode):
            return f"{p} is not a plain file"
        if what == "file" and st.st_mode & 0o022:
            return f"{p} may be written by others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def read_trusted(path: str | Path) -> str:
    """The text of a file that passes `untrusted`'s check, read through a descriptor that checked it
    (O_NOFOLLOW; fstat of what was opened), so a swap between check and read changes nothing.
    Raises PermissionError with the reason."""
    if (why := untrusted(path)) is not None:
        raise PermissionError(why)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise PermissionError(f"{path} changed while it was opened")
        return fh.read().decode("utf-8")


def own_dir(path: str | Path) -> None:
    """`path` as a private directory of this user's (0700): made so if missing; an existing one must
    be ours, no link and written by nobody else, and is tightened to 0700 (a server's store, its
    credentials). Raises PermissionError with the reason."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"{path} is not a plain directory (a link?)")
    if st.st_uid != os.geteuid():
        raise PermissionError(f"{path} belongs to uid {st.st_uid}, not to you (uid {os.geteuid()})")
    if st.st_mode & 0o022:  # anything in it may have been planted by another user
        raise PermissionError(f"{path} may be written by others (mode {stat.S_IMODE(st.st_mode):o})")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)


def private_file(path: str | Path) -> None:
    """`path` exists as a plain 0600 file of ours, made empty if missing, never through a link."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise PermissionError(f"{path} is not a plain file of yours")
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
