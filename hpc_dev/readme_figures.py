"""The command outputs in README.md and docs/*.md, regenerated from the code, so their figures
cannot go stale.

A block in README.md or a docs page (docs/capacity-plan.md holds one today) between

    <!-- dspark: plan configs/kimi-k2.6-dspark.yaml -->
    ...the command's output, indented four spaces...
    <!-- /dspark -->

is what `dspark plan configs/kimi-k2.6-dspark.yaml` prints today. The recipes name a cluster's
vLLM venv, which no login node here has and no figure depends on, so the commands run with
verifier.python set to this interpreter and the vLLM probe off (as tests/fixtures/recipes.py).
Only commands whose output is a function of the code and the config belong here: a measured
figure (a bench, a GPU run) is quoted with its date instead.

    .venv/bin/python -m hpc_dev.readme_figures          # rewrite the blocks, in every file that has one
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
DOCS = ROOT / "docs"
BLOCK = re.compile(r"^<!-- dspark: (?P<cmd>.+?) -->\n(?P<body>.*?)^<!-- /dspark -->$", re.M | re.S)
NO_VLLM = [f"verifier.python={sys.executable}", "verifier.probe=false"]
COMMANDS = {"plan"}  # what may run: pure functions of the code and the config


def output(cmd: str) -> str:
    """What `dspark CMD` prints, as the pages show it (indented, no trailing spaces)."""
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
    """(the text with every block regenerated, the commands whose block changed)."""
    stale: list[str] = []

    def fill(m: re.Match) -> str:
        body = "\n" + output(m["cmd"]) + "\n"
        if body != m["body"]:
            stale.append(m["cmd"])
        return f"<!-- dspark: {m['cmd']} -->\n{body}<!-- /dspark -->"

    return BLOCK.sub(fill, text), stale


def pages() -> list[Path]:
    """README.md and every docs page: where a block may be."""
    return [README, *sorted(DOCS.glob("*.md"))]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    any_stale = False
    for path in pages():
        text = path.read_text(encoding="utf-8")
        count = len(BLOCK.findall(text))
        if not count:
            continue
        name = path.relative_to(ROOT)
        new, stale = regenerate(text)
        any_stale = any_stale or bool(stale)
        if "--check" in argv:
            for cmd in stale:
                print(f"{name}: the output of `dspark {cmd}` has changed; run "
                      f"`.venv/bin/python -m hpc_dev.readme_figures` and commit {name}", file=sys.stderr)
            continue
        if new != text:
            path.write_text(new, encoding="utf-8")
        print(f"{name}: {count} block(s), {len(stale)} regenerated")
    return 1 if "--check" in argv and any_stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
