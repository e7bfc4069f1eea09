"""The README's command outputs, regenerated from the code, so its figures cannot go stale.

A block in README.md between

    <!-- dspark: plan configs/kimi-k2.6-dspark.yaml -->
    ...the command's output, indented four spaces...
    <!-- /dspark -->

is what `dspark plan configs/kimi-k2.6-dspark.yaml` prints today. The recipes name a cluster's
vLLM venv, which no login node here has and no figure depends on, so the commands run with
verifier.python set to this interpreter and the vLLM probe off (as tests/fixtures/recipes.py).
Only commands whose output is a function of the code and the config belong here: a measured
figure (a bench, a GPU run) is quoted with its date instead.

    .venv/bin/python -m hpc_dev.readme_figures          # rewrite the blocks
    .venv/bin/python -m hpc_dev.readme_figures --check  # exit 1 naming each stale block
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BLOCK = re.compile(r"^<!-- dspark: (?P<cmd>.+?) -->\n(?P<body>.*?)^<!-- /dspark -->$", re.M | re.S)
NO_VLLM = [f"verifier.python={sys.executable}", "verifier.probe=false"]
COMMANDS = {"plan"}  # what may run: pure functions of the code and the config


def output(cmd: str) -> str:
    """What `dspark CMD` prints, as the README shows it (indented, no trailing spaces)."""
    from hpc.cli import main  # every command: loaded only when a block is regenerated

    words = shlex.split(cmd)
    if words[0] not in COMMANDS:
        raise SystemExit(f"readme_figures: `dspark {cmd}` is not a command whose output the code decides")
    out = io.StringIO()
    with contextlib.chdir(ROOT), contextlib.redirect_stdout(out):
        code = main([*words, *NO_VLLM])
    if code:
        raise SystemExit(f"readme_figures: `dspark {cmd}` exited {code}")
    return "".join(f"    {line}".rstrip() + "\n" for line in out.getvalue().rstrip("\n").splitlines())


def regenerate(text: str) -> tuple[str, list[str]]:
    """(the README with every block regenerated, the commands whose block changed)."""
    stale: list[str] = []

    def fill(m: re.Match) -> str:
        body = "\n" + output(m["cmd"]) + "\n"
        if body != m["body"]:
            stale.append(m["cmd"])
        return f"<!-- dspark: {m['cmd']} -->\n{body}<!-- /dspark -->"

    return BLOCK.sub(fill, text), stale


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = README.read_text(encoding="utf-8")
    new, stale = regenerate(text)
    if "--check" in argv:
        for cmd in stale:
            print(f"README.md: the output of `dspark {cmd}` has changed; run "
                  "`.venv/bin/python -m hpc_dev.readme_figures` and commit README.md", file=sys.stderr)
        return 1 if stale else 0
    if new != text:
        README.write_text(new, encoding="utf-8")
    print(f"README.md: {len(BLOCK.findall(text))} block(s), {len(stale)} regenerated")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
