"""The README's walk-through of the Slurm path on this machine, run as written: a newcomer
copies those lines, so they are the test's script, not a paraphrase of it (the run itself is the
`readme_pipeline` fixture, tests/fixtures/walkthrough.py). And the command outputs quoted in
README.md and docs/*.md are what the code prints today (hpc_dev/readme_figures.py)."""

from __future__ import annotations

import shlex

import pytest

from tests.fixtures.walkthrough import walkthrough, with_overrides


def test_every_walkthrough_command_exists_and_the_cluster_is_left_down():
    from hpc.cli import COMMANDS
    from hpc_dev.dev_cli import COMMANDS as DEV_COMMANDS

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
def test_the_walkthrough_runs_as_written(readme_pipeline):
    """Its commands as written; its `Q` overrides widened for the whole-pipeline test that reads
    the same run (tests/fixtures/walkthrough.py)."""
    run = readme_pipeline
    assert run.returncode == 0, run.failure()
    out = run.stdout
    assert "debug*" in out  # sinfo: the default partition the config names
    done = [ln for ln in out.splitlines() if ln.endswith(" completed") and "," not in ln]
    assert done, out[-3000:]  # status --wait's last line: every job completed, nothing else
    # the card: a column per draft and n; the widened Q's sweep names each variant by its lr
    assert "| benchmark" in out and all(f"lr={lr} n={n}" in out for lr in ("0.001", "0.0005") for n in (3, 7)), \
        out[-3000:]
    assert (run.runs / "mlflow-server" / "credentials.env").stat().st_mode & 0o777 == 0o600


def test_the_pipeline_overrides_go_inside_q_and_nothing_else_changes():
    lines = walkthrough()
    widened = with_overrides(lines, ["a.b=1", "c=[1,2]"])
    changed = [(old, new) for old, new in zip(lines, widened, strict=True) if old != new]
    assert len(changed) == 1 and changed[0][1].startswith('Q="') and ' a.b=1 c=[1,2]"' in changed[0][1]
    assert changed[0][0].split('"')[2] == changed[0][1].split('"')[2]  # the comment after it stays


def test_the_readmes_command_outputs_are_what_the_code_prints_today():
    """Every `<!-- dspark: CMD -->` block, in README.md and the docs pages alike (the capacity plan
    moved to docs/capacity-plan.md), is what the code prints today."""
    from hpc_dev.readme_figures import BLOCK, ROOT, pages, regenerate

    texts = {path.relative_to(ROOT).as_posix(): path.read_text(encoding="utf-8") for path in pages()}
    assert "README.md" in texts and "docs/capacity-plan.md" in texts, sorted(texts)
    blocks = {name: [m["cmd"] for m in BLOCK.finditer(text)] for name, text in texts.items()}
    assert "plan configs/kimi-k2.6-dspark.yaml" in blocks["docs/capacity-plan.md"], blocks
    for name, text in texts.items():
        if blocks[name]:
            _, stale = regenerate(text)
            assert stale == [], f"stale blocks in {name} {stale}: run `.venv/bin/python -m hpc_dev.readme_figures`"
    # A figure edited by hand is caught, and the script puts the code's figure back.
    text = texts["docs/capacity-plan.md"]
    edited = text.replace("fits cluster.signal_delay_s = 300 s", "fits cluster.signal_delay_s = 90 s", 1)
    assert edited != text
    again, stale = regenerate(edited)
    assert stale == ["plan configs/kimi-k2.6-dspark.yaml"] and again == text
