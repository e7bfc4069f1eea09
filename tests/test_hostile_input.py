"""Every flag and every file a user command reads, fed what a careless or hostile user types:
bytes that are not UTF-8, control characters, empty values, oversized values and wrong types;
a config file of each kind, and a key given twice. Each is one line (exit 2), no traceback, and
nothing is created before the refusal.

The commands run in this process, in an empty working directory, against a config that names
nothing that exists here: whatever a value gets past, nothing real starts (no job, no server).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
from pathlib import Path

import pytest

from hpc import cli

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "toy-cpu.yaml"
# What `stage` and `bench` take is written by our own scripts and benchmarks, not typed by users.
COMMANDS = [name for name, _, _ in cli.COMMANDS if name not in ("stage", "bench")]
VALUES = {
    "not utf-8": os.fsdecode(b"\xff\xfe\xfd"),  # as the shell hands such bytes to Python
    "control characters": "a\x07\x1b[2Jb\x00c",
    "empty": "",
    "oversized": "9" * 100_000,
    "wrong type": "[1, {a: b}]",
}
FILES = {
    "not utf-8": b"train:\n  lr: \xff\xfe\n",
    "control characters": b"train:\n  lr: \x07\x1b\n",
    "empty": b"",
    "wrong type": b"train: [1, 2]\n",
    "a key given twice": b"train:\n  lr: 1.0e-4\ntrain:\n  lr: 2.0e-4\n",
    "not a mapping": b"- a\n- b\n",
}


def _parser(command: str) -> argparse.ArgumentParser:
    top = cli.build_parser([command])
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _leaves(parser: argparse.ArgumentParser) -> list[tuple[list[str], argparse.ArgumentParser]]:
    """(the words that select it, the parser) for the command and each of its sub-commands."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [([], parser)]
    return [([name, *words], leaf) for name, p in subs[0].choices.items() for words, leaf in _leaves(p)]


def _flags() -> list[tuple[str, list[str], str]]:
    """(command, the words before the flag, flag) for every flag that takes a value."""
    out = []
    for command in COMMANDS:
        for words, parser in _leaves(_parser(command)):
            positional = [a for a in parser._actions if not a.option_strings and a.nargs not in ("*", "?")
                          and not isinstance(a, argparse._SubParsersAction)]
            head = [command, *words, *([str(CONFIG)] * len(positional))]
            for action in parser._actions:
                if action.option_strings and action.nargs != 0 and not isinstance(action, argparse._HelpAction):
                    out.append((command, head, max(action.option_strings, key=len)))
    return out


class _Hung(Exception):
    pass


def _run(argv: list[str], capsys, limit_s: int = 60) -> tuple[int, str]:
    """The command's exit code and stderr; one that is still running after `limit_s` got past its
    input's checks and started real work (a server, a wait): that is a failure naming the input."""
    def hung(*_):
        raise _Hung(f"{' '.join(a[:40] for a in argv[:3])} ... still running after {limit_s} s")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(limit_s)
    try:
        rc = cli.run(argv)
    except SystemExit as done:  # argparse's own usage error
        rc = int(done.code or 0)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return rc, capsys.readouterr().err


@pytest.fixture
def empty_cwd(tmp_path, monkeypatch):
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    for var in ("MLFLOW_TRACKING_URI", "SLURM_CONF"):
        monkeypatch.delenv(var, raising=False)
    return work


def _one_line(rc: int, err: str, what: str) -> None:
    assert rc == 2, f"{what}: exit {rc}\n{err[-2000:]}"
    assert "Traceback" not in err, f"{what}:\n{err[-2000:]}"
    errors = [line for line in err.splitlines() if line.startswith(("error:", "dspark"))]
    assert errors, f"{what}: no error line\n{err[-2000:]}"


PATHS = re.compile(r"root|dir|out|file|path|log")  # flags that name a file or a directory


@pytest.mark.parametrize("kind", sorted(VALUES))
def test_every_flag_of_every_command_refuses_a_hostile_value_in_one_line(kind, empty_cwd, capsys):
    a_file = empty_cwd.parent / "a-file"
    a_file.write_text("not a directory\n")
    for command, head, flag in _flags():
        # A path's wrong type is a file where a directory goes (`[1, {a: b}]` is a legal name)
        value = str(a_file) if kind == "wrong type" and PATHS.search(flag) else VALUES[kind]
        rc, err = _run([*head, flag, value], capsys)
        _one_line(rc, err, f"{' '.join(head[:2])} {flag} <{kind}>")
        assert list(empty_cwd.iterdir()) == [], f"{command} {flag} <{kind}> created {list(empty_cwd.iterdir())}"


@pytest.mark.parametrize("kind", sorted(FILES))
def test_every_command_that_reads_a_config_refuses_a_hostile_file_in_one_line(kind, empty_cwd, capsys):
    bad = empty_cwd.parent / "bad.yaml"
    bad.write_bytes(FILES[kind])
    for command in COMMANDS:
        for words, parser in _leaves(_parser(command)):
            names = [a.dest for a in parser._actions if not a.option_strings]
            if "config" not in names:
                continue
            rc, err = _run([command, *words, str(bad)], capsys)
            _one_line(rc, err, f"{command} {' '.join(words)} <{kind} file>")
            assert list(empty_cwd.iterdir()) == [], f"{command} <{kind} file> created {list(empty_cwd.iterdir())}"


@pytest.mark.parametrize("kind", sorted(VALUES))
def test_every_override_refuses_a_hostile_value_and_a_key_given_twice(kind, empty_cwd, capsys):
    for override in ([f"train.lr={VALUES[kind]}"], [f"tracking.experiment={VALUES[kind]}"],
                     ["train.lr=1e-4", "train.lr=2e-4"]):
        rc, err = _run(["validate", str(CONFIG), "--offline", *override], capsys)
        _one_line(rc, err, f"validate {override[0][:30]!r}")
