"""Fast checks of the toy target's command line and cache key (no build)."""

from __future__ import annotations

from pathlib import Path

from hpc.cli import build_parser
from hpc_dev import toy, toy_config, toy_corpus, toy_train
from hpc_dev.toy_config import ToyConfig


def test_toy_target_command_registers():
    # hpc_dev.toy_cli once imported ARCHS from hpc_dev.toy, which does not define it: ImportError.
    args = build_parser(["toy-target"]).parse_args(["toy-target", "--arch", "qwen3"])
    assert args.arch == "qwen3"


def test_build_key_hashes_the_build_code(monkeypatch):
    monkeypatch.setattr(toy_corpus, "fingerprint", lambda: b"")
    read: list[Path] = []
    original = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: read.append(self.resolve()) or original(self))
    toy.build_key(ToyConfig())
    modules = {Path(m.__file__).resolve() for m in (toy, toy_config, toy_train)}
    assert modules <= set(read)
