"""The guard between a process and the server it starts: the server dies with its starter.

`hpc.proc.spawn` runs `python -I proc_guard.py STARTER_PID GRACE_S CLEANUP_JSON -- CMD...` in a
session of its own; the guard runs CMD in that session and waits. When CMD ends, the guard
exits with its code. When the starter dies first (a SIGKILLed rank or `dspark train`, which
can run no handler), the guard is re-parented: it stops the whole session (SIGTERM, then
SIGKILL after the grace), removes the starter's temp paths (capture directory, plugin dirs),
and sweeps the shared-memory segments its server's processes left in /dev/shm. Without it, a
vLLM outlives its rank and keeps the node's GPUs and RAM (seen twice).

Why a process and not PR_SET_PDEATHSIG: the kernel sends that signal when the *thread* that
forked the server exits, not the process, so a server started from a short-lived thread would
die early; and a signalled server cannot clean up after itself.

Stdlib only, run by path with `-I`: it imports nothing of ours, so it starts in milliseconds.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

POLL_S = 0.5
SHM = "/dev/shm"


def session_members() -> list[int]:
    """Pids of this session (the server's processes), this guard excluded."""
    me, sid = os.getpid(), os.getsid(0)
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # fields[3]: session id; Z: a zombie holds nothing
            found.append(int(name))
    return found


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def mapped_shm(root: str = SHM, pids: list[int] | None = None) -> set[str]:
    """Names directly under `root` that a live process we can see (or one of `pids`) maps or holds open."""
    names: set[str] = set()
    prefix = root.rstrip("/") + "/"
    for pid in map(str, pids) if pids is not None else os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    if f" {prefix}" in line:
                        names.add(line.split(f" {prefix}", 1)[1].split("/")[0].split()[0])
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(prefix):
                    names.add(target[len(prefix):].split("/")[0].removesuffix(" (deleted)"))
        except OSError:
            continue
    return names


def pid_alive(pid: int) -> bool:
    """As hpc.fsio._alive: repeated, not imported, because the guard runs by path and imports nothing of ours."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_shm(min_age_s: float = 30.0, root: str = SHM) -> list[str]:
    """Remove what our killed servers left in /dev/shm: this user's vLLM segments (`psm_*`) that
    no live process maps or holds open, and capture directories whose starter pid is dead. Young
    segments are left alone (one may be between its creation and its first map)."""
    uid, now = os.getuid(), time.time()
    try:
        entries = os.listdir(root)
    except OSError:
        return []
    removed, in_use = [], None
    for name in entries:
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_uid != uid:
            continue
        if name.startswith("psm_") and now - st.st_mtime > min_age_s:
            in_use = mapped_shm(root) if in_use is None else in_use
            if name not in in_use:
                try:
                    os.unlink(path)
                    removed.append(path)
                except OSError:
                    pass
        elif name.startswith(f"dspark-{uid}-") and "-pid" in name:
            pid = name.split("-pid", 1)[1].split("-", 1)[0]
            if pid.isdigit() and not pid_alive(int(pid)):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


def take_down(child: subprocess.Popen, grace_s: float, cleanup: list[str]) -> None:
    ours = mapped_shm(pids=session_members())  # the segments this server holds: gone with it
    signal_all(session_members(), signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while session_members() and time.monotonic() < deadline:
        time.sleep(0.2)
    ours |= mapped_shm(pids=session_members())
    signal_all(session_members(), signal.SIGKILL)
    deadline = time.monotonic() + 10
    while session_members() and time.monotonic() < deadline:
        time.sleep(0.05)
    child.poll()
    for path in cleanup:
        shutil.rmtree(path, ignore_errors=True)
    still = mapped_shm()
    for name in ours - still:  # a segment another live process maps stays: it is in use
        try:
            if os.lstat(os.path.join(SHM, name)).st_uid == os.getuid():
                os.unlink(os.path.join(SHM, name))
        except OSError:
            pass
    sweep_shm(min_age_s=5.0)


def main(argv: list[str]) -> int:
    starter, grace_s, cleanup, cmd = int(argv[0]), float(argv[1]), json.loads(argv[2]), argv[4:]
    assert argv[3] == "--" and cmd, "usage: proc_guard.py STARTER_PID GRACE_S CLEANUP_JSON -- CMD..."
    child = subprocess.Popen(cmd)  # in the guard's session: a signal to the session reaches it

    def forward(signum, _frame):  # `stop()` signals the session; a signal to the guard alone is passed on
        if child.poll() is None:
            child.send_signal(signum)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    while True:
        try:
            code = child.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass
        else:
            if code < 0:  # killed by a signal: die of the same one, so the starter sees what it would have
                signal.signal(-code, signal.SIG_DFL)
                os.kill(os.getpid(), -code)
            return code
        if os.getppid() != starter:  # re-parented: the starter is gone
            print(f"proc_guard: the process that started this server (pid {starter}) is gone; stopping it",
                  flush=True)
            take_down(child, grace_s, cleanup)
            return 128 + signal.SIGTERM


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
