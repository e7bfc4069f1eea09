"""The Python files of GPU vLLM wheels (0.33.0, 0.34.0), for tests that ask vLLM's own source
what it decides on a GPU this machine does not have (hpc/verifier/vllm_adaptive.py).

A wheel is fetched once with `pip download --no-deps` (no install: it is a CUDA build), its
`vllm/**.py` files extracted into ~/.cache/dspark/vllm-src-VERSION, and the wheel deleted
(300 MB each, of which the sources are a few). A marker written last makes an interrupted
extraction redone, not trusted.

    .venv/bin/python -m hpc_dev.vllm_sources 0.33.0 0.34.0      # prints each tree's vllm/ dir
"""

from __future__ import annotations

import fcntl
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

VERSIONS = ("0.33.0", "0.34.0")  # the GPU pin and the newest release (docs/vllm-serving.md, "The vLLM pin")
MARKER = ".dspark-ready"


class VllmSourcesError(RuntimeError):
    """The wheel could not be fetched or read; the message says why."""


def source_dir(version: str) -> Path:
    return Path("~/.cache/dspark").expanduser() / f"vllm-src-{version}"


def ensure_vllm_sources(version: str) -> Path:
    """The extracted `vllm/` package directory of that release, fetched on first use."""
    root = source_dir(version)
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"vllm-src-{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two xdist workers: one fetches, the other waits
        if (root / MARKER).is_file():
            return root / "vllm"
        with tempfile.TemporaryDirectory(dir=root.parent) as tmp:
            got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                                  "-d", tmp, f"vllm=={version}"], capture_output=True, text=True, timeout=1800)
            wheels = sorted(Path(tmp).glob(f"vllm-{version}-*.whl"))
            if got.returncode != 0 or not wheels:
                tail = (got.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
                raise VllmSourcesError(f"pip download vllm=={version} failed: {tail}")
            with zipfile.ZipFile(wheels[0]) as whl:
                names = [n for n in whl.namelist() if n.startswith("vllm/") and n.endswith(".py")]
                whl.extractall(root, members=names)
        (root / MARKER).write_text(version + "\n")
    return root / "vllm"


if __name__ == "__main__":
    for v in sys.argv[1:] or VERSIONS:
        print(ensure_vllm_sources(v))
