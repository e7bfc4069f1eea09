"""What a login node runs imports no torch: validate, plan, submit --dry-run and status. torch
costs a second per command there and a login node may not have it; the stages' own jobs do.
(`submit --dry-run` is held to it in tests/launch/test_submit.py, on the local cluster.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KIMI = "configs/kimi-k2.6-dspark.yaml"
HEAVY = ("torch", "transformers", "safetensors", "vllm", "ray")
# Run the console entry in a fresh interpreter, then say which heavy modules it had imported.
WRAPPER = ("import sys\nfrom hpc.cli import main\ntry:\n    code = main(sys.argv[1:])\nexcept SystemExit as e:\n"
           "    code = e.code\nprint('\\nheavy-imports:', sorted(m for m in sys.modules if m.split('.')[0] in "
           f"{HEAVY!r}))\nsys.exit(code)")


def login_run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WRAPPER, *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


def heavy_imports(res: subprocess.CompletedProcess) -> str:
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("heavy-imports:")]
    assert line, res.stdout[-2000:] + res.stderr[-2000:]
    return line[-1].removeprefix("heavy-imports:").strip()


@pytest.mark.parametrize("args", [["validate", KIMI, "--offline"], ["plan", KIMI],
                                  ["status", "--log-dir", "{tmp}"]], ids=["validate", "plan", "status"])
def test_the_login_commands_import_no_torch(args, tmp_path):
    res = login_run(*[a.replace("{tmp}", str(tmp_path)) for a in args])
    assert heavy_imports(res) == "[]", res.stdout[-1500:]


def test_the_wrapper_sees_a_heavy_import():
    """The guard above can fail: a command that does load torch is reported as such."""
    res = subprocess.run([sys.executable, "-c", WRAPPER.replace("from hpc.cli import main",
                                                                 "import torch\nfrom hpc.cli import main"), "plan", KIMI],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert "'torch'" in heavy_imports(res)
