"""Every config key is read by the code it configures, not only by `dspark validate`.

A key that nothing reads lets a user tune a knob that does nothing (as `stream.port` and
`eval.concurrency` did). The check is static: the AST of every module in `hpc/` except the
schema itself and the validation modules, looking for `<section>.<key>` reads, where the
section is an attribute chain ending in the section's name (`cfg.stream.prefetch`), a local
bound to one (`st = cfg.stream; st.prefetch`, `for src in cfg.data.sources: src.path`), a
parameter annotated with the section's class (`v: VerifierConfig`) or named for it
(`train_cfg`). Top-level keys (`name`, `sweep`) count as read by any `.name` access.
"""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

from hpc.config import schema

HPC = Path(__file__).resolve().parents[2] / "hpc"
# Checking a key is not reading it: validate may consult every key.
NOT_READERS = {"config/schema.py", "config/validate.py", "config/validate_ops.py", "config/inputs.py"}

# Keys the code has no reason to read, each with the reason.
UNREAD_ON_PURPOSE = {
    # Relaxes the check that our vLLM servers listen on loopback only.
    "verifier.allow_remote_host",
    # Says whether `dspark validate` asks the vLLM at verifier.python what it serves.
    "verifier.probe",
    # Says whether `dspark validate` runs where the work runs, so it checks this machine's devices
    # (the demo sets it; its stages resolve with runs_here=True themselves).
    "cluster.executor",
    # An interpolation of draft.draft_vocab_size kept so the data section shows the value its
    # vocabulary pruning used; the code reads the draft's copy.
    "data.draft_vocab_size",
    # Read as the `sources` of the calibration rows' own data config (`calibration_data` in
    # hpc/data/regenerate.py), which this static trace does not follow.
    "data.calibration_sources.path", "data.calibration_sources.split", "data.calibration_sources.max_rows",
}


def _sections(root: type) -> dict[str, tuple[type, str]]:
    """Dotted section path -> (its dataclass, the attribute name code reaches it by)."""
    out: dict[str, tuple[type, str]] = {}

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            inner = typing.get_args(hint)[0] if typing.get_origin(hint) is list else hint
            if dataclasses.is_dataclass(inner):
                path = prefix + f.name
                out[path] = (inner, f.name)
                walk(inner, path + ".")

    walk(root, "")
    return out


def schema_keys(root: type = schema.DSparkConfig) -> list[tuple[str, str, str]]:
    """(dotted key, section attribute name or "" for the root, leaf name) for every leaf."""
    keys = []
    sections = _sections(root)
    for cls, section, prefix in [(root, "", "")] + [
        (cls, attr, path + ".") for path, (cls, attr) in sections.items()
    ]:
        for f in dataclasses.fields(cls):
            if prefix + f.name not in sections:
                keys.append((prefix + f.name, section, f.name))
    return keys


def _ends_in(node: ast.AST, attr: str) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == attr


def _aliases(scope: ast.AST, section: str, cls_name: str) -> set[str]:
    """Expressions (as source text) that hold the section, or one item of a list section:
    `st` after `st = cfg.stream`, `self.cfg` after `self.cfg = train_cfg`, a loop variable."""
    found: set[str] = set()
    if isinstance(scope, ast.ClassDef) and scope.name == cls_name:  # the section's own methods (DraftArgs)
        found |= {"self", "cls"}

    def holds(value: ast.AST) -> bool:
        return _ends_in(value, section) or ast.unparse(value) in found

    for node in ast.walk(scope):
        if isinstance(node, ast.arg) and node.annotation is not None and cls_name in ast.unparse(node.annotation):
            found.add(node.arg)
        elif isinstance(node, ast.arg) and node.arg in (f"{section}_cfg", f"{section}_config"):
            found.add(node.arg)
    while True:
        before = len(found)
        for node in ast.walk(scope):
            pairs: list[tuple[ast.AST, ast.AST]] = []
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                        pairs += zip(target.elts, node.value.elts)  # c, v = cfg.cluster, cfg.verifier
                    else:
                        pairs.append((target, node.value))
            elif isinstance(node, (ast.For, ast.comprehension)):
                pairs.append((node.target, node.iter))
            found |= {ast.unparse(t) for t, v in pairs if holds(v)}
        if len(found) == before:
            return found


class _Scope:
    """One top-level function or class (or the module itself), indexed by attribute name."""

    def __init__(self, node: ast.AST):
        self.node = node
        self.bases: dict[str, list[ast.AST]] = {}
        for n in ast.walk(node):
            if isinstance(n, ast.Attribute):
                self.bases.setdefault(n.attr, []).append(n.value)
        self._aliases: dict[str, set[str]] = {}

    def aliases(self, section: str, cls_name: str) -> set[str]:
        if section not in self._aliases:
            self._aliases[section] = _aliases(self.node, section, cls_name)
        return self._aliases[section]

    def reads(self, section: str, cls_name: str, key: str) -> bool:
        bases = self.bases.get(key, [])
        if not section:
            return bool(bases)
        if any(_ends_in(b, section) for b in bases):
            return True
        return bool(bases) and any(ast.unparse(b) in self.aliases(section, cls_name) for b in bases)


def unread_keys(root: type = schema.DSparkConfig) -> list[str]:
    scopes = [_Scope(n) for p in sorted(HPC.rglob("*.py")) if p.relative_to(HPC).as_posix() not in NOT_READERS
              for tree in [ast.parse(p.read_text())]
              for n in tree.body + [tree] if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.Module))]
    sections = _sections(root)
    unread = []
    for key, section, leaf in schema_keys(root):
        if key in UNREAD_ON_PURPOSE:
            continue
        parent = key.rpartition(".")[0]
        cls_name = sections[parent][0].__name__ if parent else root.__name__
        if not any(scope.reads(section, cls_name, leaf) for scope in scopes):
            unread.append(key)
    return unread


def test_every_schema_key_is_read_outside_validation():
    assert unread_keys() == []


@dataclasses.dataclass
class _Stream(schema.StreamConfig):
    port: int = 0  # a common name: servers' ports are read, this one is not
    never_read_anywhere: int = 0


@dataclasses.dataclass
class _Config(schema.DSparkConfig):
    stream: _Stream = dataclasses.field(default_factory=_Stream)


def test_the_check_finds_a_key_nothing_reads():
    # The check must not pass by seeing every key as read: a name no module uses is reported,
    # and so is a common name read only on other objects.
    assert unread_keys(_Config) == ["stream.port", "stream.never_read_anywhere"]
    assert ("stream.prefetch", "stream", "prefetch") in schema_keys(_Config)


def test_removed_keys_are_gone_from_the_schema():
    # A key listed as removed but still in the schema would be accepted, never reported.
    from hpc.config.load import REMOVED

    assert not set(REMOVED) & {key for key, _, _ in schema_keys()}
