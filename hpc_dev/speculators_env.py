"""A separate Python 3.11 venv holding `speculators==0.9.0`, built once per machine and reused.

speculators pins `transformers<=5.19.0` (we run 5.24) and pulls torchvision/torchaudio (PyPI
builds that break beside the local CPU torch), typer, psutil...; importing
`speculators.models.dspark` needs few of them. So the venv gets the local CPU torch wheel,
then speculators with `--no-deps`, then only the packages its import chain touches. Our code
reaches it through subprocesses with PYTHONPATH=<repo>: `hpc.model` needs only torch +
safetensors. Cold build ~3 min (177 s measured), warm lookup ~0.1 s.

The venv is marked ready by a file written last, so an interrupted build is redone, not trusted.

    .venv/bin/python -m hpc_dev.speculators_env      # builds if needed, prints the python
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

SPECULATORS_VERSION = "0.9.0"
TORCH_VERSION = "2.13.0"
# The newest transformers speculators 0.9.0 accepts (it pins <=5.19.0).
TRANSFORMERS_VERSION = "5.19.0"
# What `import speculators.models.dspark` really imports besides torch (read from its sources):
# transformers (+ huggingface-hub, numpy), pydantic, loguru, safetensors; and, because
# `speculators/__init__` imports every model and eagle3/mtp import `speculators.train.data`
# at module level: openai, datasets and hs-connectors (torch + safetensors only). Never
# imported: pydantic-settings, typer, psutil, protobuf, torchvision/torchaudio.
MODEL_DEPS = [
    f"transformers=={TRANSFORMERS_VERSION}", "pydantic>=2", "loguru>=0.7.2,<=0.7.3", "numpy>=2,<=2.5.4",
    "safetensors", "openai>=2", "datasets>=4,<=5.1.0", f"hs-connectors=={SPECULATORS_VERSION}",
]
# Never wanted here: PyPI's builds are linked against a different torch and break its import.
UNWANTED = ["torchvision", "torchaudio", "torchcodec"]
MARKER = ".dspark-ready"
DEFAULT_WHEEL_DIR = "/opt/wheels"
ENV_VAR = "DSPARK_SPECULATORS_VENV"


class SpeculatorsEnvError(RuntimeError):
    """The speculators venv could not be built; the message says why and where the log is."""


def default_venv_dir() -> Path:
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env).expanduser()
    return Path("~/.cache/dspark").expanduser() / f"speculators-{SPECULATORS_VERSION}"


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def is_ready(venv: Path | None = None) -> bool:
    venv = Path(venv) if venv else default_venv_dir()
    return (venv / MARKER).is_file() and venv_python(venv).exists()


def _wheel_dir() -> Path:
    return Path(os.environ.get("DSPARK_WHEEL_DIR", DEFAULT_WHEEL_DIR))


def _torch_requirement() -> str:
    """The local CPU wheel by exact local version, so pip can never pick a CUDA build from PyPI."""
    wheels = sorted(_wheel_dir().glob(f"torch-{TORCH_VERSION}+cpu-cp311-*.whl"))
    if not wheels:
        raise SpeculatorsEnvError(
            f"torch {TORCH_VERSION}+cpu (cp311) not found in {_wheel_dir()}; set DSPARK_WHEEL_DIR "
            f"to a directory holding it (a CUDA torch from PyPI is never installed here)")
    return f"torch=={TORCH_VERSION}+cpu"


def _python311() -> str:
    for cand in (os.environ.get("DSPARK_SPECULATORS_BASE_PYTHON"), "python3.11", sys.executable):
        if not cand:
            continue
        try:
            probe = subprocess.run([cand, "-c", "import sys, venv; print(sys.version_info[:2] == (3, 11))"],
                                   capture_output=True, text=True)
        except OSError:
            continue
        if probe.returncode == 0 and probe.stdout.strip() == "True":
            return cand
    raise SpeculatorsEnvError("no Python 3.11 found (speculators needs >=3.11 and our code 3.11); "
                              "set DSPARK_SPECULATORS_BASE_PYTHON")


def _run_logged(cmd: list[str], log: Path) -> None:
    with log.open("a") as fh:
        fh.write(f"\n$ {' '.join(cmd)}\n")
        fh.flush()
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise SpeculatorsEnvError(f"`{' '.join(cmd[:5])} ...` failed (exit {rc}); see {log}:\n{tail}")


# Run inside the new venv: the model classes import, and torch is the CPU build we installed.
_SMOKE = (
    "import torch, transformers, speculators.models.dspark as d; "
    "assert torch.version.cuda is None, torch.version.cuda; "
    "print(torch.__version__, transformers.__version__, d.DSparkDraftModel.__name__)"
)


def _build(venv: Path, log: Path) -> None:
    py = str(venv_python(venv))
    pip = [py, "-m", "pip", "install", "--find-links", str(_wheel_dir())]
    _run_logged([_python311(), "-m", "venv", "--clear", str(venv)], log)
    _run_logged(pip + [_torch_requirement()], log)
    _run_logged(pip + ["--no-deps", f"speculators=={SPECULATORS_VERSION}"], log)
    # torch is pinned so no dependency resolution can swap it for another build.
    _run_logged(pip + [_torch_requirement(), *MODEL_DEPS], log)
    _run_logged([py, "-m", "pip", "uninstall", "-y", *UNWANTED], log)
    _run_logged([py, "-c", _SMOKE], log)


def ensure_speculators_venv(venv: Path | None = None, *, verbose: bool = True) -> Path:
    """The venv's python, building the venv first unless it is marked ready.

    Raises SpeculatorsEnvError (with the log's tail) when it cannot be built.
    """
    venv = Path(venv) if venv else default_venv_dir()
    if is_ready(venv):
        return venv_python(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    # Two pytest sessions on one machine must not pip-install into the same venv at once.
    with open(venv.parent / f".{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_ready(venv):
            return venv_python(venv)
        log = venv.parent / f"{venv.name}.install.log"
        log.write_text("")
        if verbose:
            print(f"building the speculators venv in {venv} (log: {log})", file=sys.stderr)
        start = time.monotonic()
        _build(venv, log)
        with log.open("a") as fh:
            fh.write(f"\nbuilt in {time.monotonic() - start:.0f} s\n")
        (venv / MARKER).write_text(f"speculators=={SPECULATORS_VERSION} torch=={TORCH_VERSION}+cpu "
                                   f"transformers=={TRANSFORMERS_VERSION}\n")
    return venv_python(venv)


def main() -> int:
    try:
        print(ensure_speculators_venv())
    except SpeculatorsEnvError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
