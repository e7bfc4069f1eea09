"""What a cluster installs: `pip install .` ships `hpc` and the `dspark` command only. The CPU
proving ground's tooling (`hpc_dev`, `dspark-dev`) is its own distribution, which the
repository's setup installs beside it (scripts/setup.sh)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def build_wheel(src: Path, out: Path) -> zipfile.ZipFile:
    before = set(out.glob("*.whl")) if out.exists() else set()
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                          "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (wheel,) = set(out.glob("*.whl")) - before
    return zipfile.ZipFile(wheel)


def entry_points(wheel: zipfile.ZipFile) -> str:
    return wheel.read(next(n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt"))).decode()


@pytest.mark.slow
def test_a_cluster_install_ships_hpc_and_the_dev_tools_are_their_own_distribution(tmp_path):
    src = tmp_path / "src"  # a copy: setuptools writes build/ and egg-info into the tree it builds
    for pkg in ("hpc", "hpc_dev"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)

    cluster = build_wheel(src, tmp_path / "wheels")
    names = cluster.namelist()
    assert "hpc/cli.py" in names and "hpc/train/trainer.py" in names
    assert [n for n in names if n.startswith("hpc_dev")] == []
    assert "dspark = hpc.cli:main" in entry_points(cluster) and "dspark-dev" not in entry_points(cluster)

    dev = build_wheel(src / "hpc_dev", tmp_path / "wheels")
    names = dev.namelist()
    assert "hpc_dev/dev_cli.py" in names and "hpc_dev/devcluster.py" in names
    assert [n for n in names if n.startswith("hpc/")] == []
    assert "dspark-dev = hpc_dev.dev_cli:main" in entry_points(dev)


def test_the_dev_command_holds_the_dev_tools_and_dspark_does_not():
    from hpc.bench import BENCHMARKS
    from hpc.cli import COMMANDS
    from hpc_dev.dev_cli import BENCHMARKS as DEV_BENCHMARKS
    from hpc_dev.dev_cli import COMMANDS as DEV_COMMANDS

    dev = {name for name, _, _ in DEV_COMMANDS}
    assert {"demo", "devcluster", "toy-target", "bench"} <= dev
    assert not dev - {"bench"} & {name for name, _, _ in COMMANDS}
    # dspark's own run on a cluster: the stream between real nodes, training jobs sharing a
    # verifier against one alone, a watch tick on the login node
    assert set(BENCHMARKS) == {"stream", "share", "watch"}
    assert {"acceptance", "capture", "train-step", "toy-target"} <= set(DEV_BENCHMARKS)
