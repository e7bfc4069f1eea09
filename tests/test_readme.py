"""The README's walk-through of the Slurm path on this machine, run as written: a newcomer
copies those lines, so they are the test's script, not a paraphrase of it."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## The Slurm path on this machine"


def walkthrough() -> list[str]:
    """The first indented block under SECTION, one command per line."""
    text = (ROOT / "README.md").read_text()
    assert SECTION in text, f"README.md has no {SECTION!r} section"
    lines: list[str] = []
    for line in text.split(SECTION, 1)[1].splitlines():
        if line.startswith("    "):
            lines.append(line[4:])
        elif lines:
            break
    assert lines, f"no command block under {SECTION!r}"
    return lines


def test_every_walkthrough_command_exists_and_the_cluster_is_left_down():
    from hpc.cli import COMMANDS
    from hpc_dev.cli import COMMANDS as DEV_COMMANDS

    tables = {"dspark": {c for c, _, _ in COMMANDS}, "dspark-dev": {c for c, _, _ in DEV_COMMANDS}}
    used = []
    for line in walkthrough():
        words = shlex.split(line.split("#", 1)[0].replace("$(", " ").replace(")", " "), posix=True)
        for i, word in enumerate(words[:-1]):
            prog = word.removeprefix(".venv/bin/")
            if prog in tables:
                assert word.startswith(".venv/bin/"), f"{line}: the venv's {prog}, which setup installed"
                assert words[i + 1] in tables[prog], f"{line}: `{prog} {words[i + 1]}` is no command"
                used.append(f"{prog} {words[i + 1]}")
    for needed in ("dspark-dev devcluster", "dspark tracking", "dspark submit", "dspark status", "dspark compare"):
        assert needed in used, f"the walk-through never runs `{needed}`"
    assert walkthrough()[-1].endswith("dspark-dev devcluster down")


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_the_walkthrough_runs_as_written(slurm_cluster, vllm_python, tmp_path):
    *lines, last = walkthrough()
    assert last == "kill $TRACKING; .venv/bin/dspark-dev devcluster down"
    # The last line stops the tracking server (the trap below does) and the cluster, which this
    # session's other tests share: that one is left to the fixture.
    work = tmp_path / "checkout"  # relative paths as in a checkout; what the run writes stays here
    work.mkdir()
    for name in (".venv", "configs"):
        (work / name).symlink_to(ROOT / name)
    (work / "runs").mkdir()
    script = "\n".join(["set -euo pipefail", 'trap \'[ -z "${TRACKING:-}" ] || kill "$TRACKING"\' EXIT', *lines])
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_TRACKING_")}
    res = subprocess.run(["bash", "-c", script], cwd=work, env=env, capture_output=True, text=True, timeout=2300)
    log = (work / "runs" / "tracking.log").read_text(errors="replace") if (work / "runs" / "tracking.log").exists() else ""
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:] + log[-1500:]
    out = res.stdout
    assert "debug*" in out  # sinfo: the default partition the config names
    done = [ln for ln in out.splitlines() if ln.endswith(" completed") and "," not in ln]
    assert done, out[-3000:]  # status --wait's last line: every job completed, nothing else
    assert "| benchmark" in out and "DSpark n=3" in out and "DSpark n=7" in out, out[-3000:]
    assert (work / "runs" / "mlflow-server" / "credentials.env").stat().st_mode & 0o777 == 0o600
