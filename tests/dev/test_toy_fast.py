"""Fast checks of the toy target's command line and cache key (no build)."""

from __future__ import annotations

from pathlib import Path

from hpc_dev import toy, toy_config, toy_corpus, toy_train
from hpc_dev.dev_cli import build_parser
from hpc_dev.toy_config import ToyConfig


def test_toy_target_command_registers():
    # hpc_dev.toy_cli once imported ARCHS from hpc_dev.toy, which does not define it: ImportError.
    args = build_parser(["toy-target"]).parse_args(["toy-target", "--arch", "qwen3"])
    assert args.arch == "qwen3"


def test_build_key_hashes_the_build_code(monkeypatch):
    monkeypatch.setattr(toy_corpus, "fingerprint", lambda: b"")
    original = Path.read_bytes
    base = toy.build_key(ToyConfig())
    for module in (toy, toy_config, toy_train):  # an edit to any build module is a new target
        edited = Path(module.__file__).resolve()
        monkeypatch.setattr(Path, "read_bytes",
                            lambda self, e=edited: original(self) + (b"# edit" if self.resolve() == e else b""))
        assert toy.build_key(ToyConfig()) != base, module.__name__
    monkeypatch.setattr(Path, "read_bytes", original)
    assert toy.build_key(ToyConfig()) == base
