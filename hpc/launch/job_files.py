"""Small secrets one node of a job hands the others: written once, owner-only, checked on read.

The torch rendezvous port and the Ray head's port and token are chosen at run time by the node
that listens (a free port on its own address), not derived from the job id: derived ports of
two jobs collide, and anyone can compute them. They travel through a 0600 file under the
job's log directory (a filesystem every node sees). The file is created exclusively (a hard
link of a complete temp file, which fails if the name exists), so nobody can have planted it
first, and a reader refuses a file that is not ours or that others can read.
"""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

from hpc.errors import UserError
from hpc.fsio import write_text


def attempt(job_id: int) -> str:
    """This run of the job: a requeue is a new attempt, with files of its own."""
    return f"{job_id}-{os.environ.get('SLURM_RESTART_COUNT', '0')}"


def job_file(root: str | Path, kind: str, job_id: int) -> Path:
    return Path(root) / f".{kind}-{attempt(job_id)}"


# A job's files are written as its nodes start, and read within minutes. One older than its
# reader's start by more than this is from an earlier job that had the same id: a reinstalled
# cluster counts from 1 again, and a node that died never removed its files.
STALE_S = 600.0


# This process's start, near enough: a node's stage imports this module as it begins.
STARTED = time.time()


def stale(path: Path, started: float = STARTED) -> bool:
    """`path` is an owner-only file of ours written long before `started`: an earlier job's."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return owner_only(st) and st.st_mtime < started - STALE_S


def publish(path: Path, payload: dict) -> None:
    """Create `path` (0600) holding `payload`; refuse if it exists already, unless it is an
    earlier job's (`stale`): that one is replaced."""
    if stale(path):
        path.unlink(missing_ok=True)
    try:
        write_text(path, json.dumps(payload), mode=0o600, exclusive=True)
    except FileExistsError:
        raise UserError(f"{path} exists already: another process of this job (or someone else) wrote "
                        "it first; remove it if no job of yours is running") from None


def visible(path: Path) -> bool:
    """exists(), past an NFS client's negative-lookup cache (listing the directory revalidates it)."""
    try:
        return path.name in os.listdir(path.parent)
    except OSError:
        return False


def owner_only(st: os.stat_result) -> bool:
    """A plain file of this user that nobody else may read or write: what publish() creates."""
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def read_published(path: Path) -> dict:
    st = os.lstat(path)
    if not owner_only(st):
        raise UserError(f"{path} is not an owner-only file of yours (mode {stat.filemode(st.st_mode)}, uid "
                        f"{st.st_uid}); refusing to trust it. Remove it and re-run the job")
    return json.loads(path.read_text())


def wait_published(path: Path, timeout_s: float, who: str, gone: Path | None = None) -> dict | None:
    """The payload once `who` has published it; None if `gone` appears first (it came and went).
    An earlier job's file (`stale`) is neither: the wait goes on."""
    deadline = time.monotonic() + timeout_s
    while not visible(path) or stale(path):
        if gone is not None and visible(gone) and not stale(gone):
            return None
        if time.monotonic() > deadline:
            raise UserError(f"{who} published nothing in {timeout_s:.0f}s ({path}); see {who}'s log")
        time.sleep(0.5)
    return read_published(path)
