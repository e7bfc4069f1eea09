"""Imports go one way: down the layers the README's Layout section draws.

Every `import` in hpc/ (module level or inside a function: a lazy import is still a
dependency) must name a module of a lower layer or of its own package. Development tooling
(hpc_dev) sits above the production package, which never imports it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Top to bottom. A package may import its own modules and any package of a LOWER layer.
LAYERS: list[tuple[str, ...]] = [
    ("hpc.__main__",),  # `python -m hpc`
    ("hpc.cli", "hpc.bench"),  # the command line: tables naming every command and benchmark
    ("hpc.launch",),  # the Slurm launcher: submit, stages, status, schedule, plan
    ("hpc.train",),  # the trainer (online: verifier + stream + DDP)
    ("hpc.evaluate",),  # spec-decode evaluation, compare
    ("hpc.verifier",),  # vLLM / HF capture, regeneration
    ("hpc.stream",),  # streamer -> trainer transport; Capture, MicroBatch
    ("hpc.track",),  # MLflow
    ("hpc.model",),  # the draft, its loss, export
    ("hpc.config",),  # schema, loading, login-node validation
    ("hpc.dist",),  # the NCCL-rules checker and the two planes
    ("hpc.proc",),  # a server in a subprocess: spawn, health, stop (VLLMServer, MlflowServer)
    ("hpc", "hpc.errors", "hpc.fsio", "hpc.net", "hpc.tables", "hpc.proc_guard", "hpc.own_env"),  # no deps in hpc
]


def _package(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def _layer(module: str) -> int:
    pkg = _package(module)
    for i, members in enumerate(LAYERS):
        if pkg in members:
            return i
    raise AssertionError(f"{module}: no layer in tests/test_layers.py LAYERS; add its package there "
                         f"and to the README's Layout section")


def _imports(path: Path, module: str) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from hpc import x` imports the module hpc.x
            found += [(node.lineno, f"{node.module}.{a.name}" if node.module in ("hpc", "hpc_dev") else node.module)
                      for a in node.names]
    return [(line, name) for line, name in found if name.split(".")[0] in ("hpc", "hpc_dev")]


def _modules(top: str) -> list[tuple[Path, str]]:
    out = []
    for path in sorted((ROOT / top).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out.append((path, ".".join(parts[:-1] if parts[-1] == "__init__" else parts)))
    return out


def violations(top: str = "hpc") -> list[str]:
    bad = []
    for path, module in _modules(top):
        for line, name in _imports(path, module):
            where = f"{path.relative_to(ROOT)}:{line} imports {name}"
            if top == "hpc" and name.startswith("hpc_dev"):
                bad.append(f"{where}: production code never imports development tooling")
            elif top == "hpc" and _package(name) != _package(module) and _layer(name) <= _layer(module):
                bad.append(f"{where}: against the layer order")
    return bad


def test_production_imports_go_down_the_layers():
    assert violations("hpc") == []


def test_every_module_has_a_layer():
    for _, module in _modules("hpc"):
        _layer(module)


def test_the_check_catches_an_import_against_the_grain(tmp_path):
    (tmp_path / "hpc" / "model").mkdir(parents=True)
    (tmp_path / "hpc" / "model" / "bad.py").write_text(
        "def f():\n    from hpc.train.loop import Trainer\n    from hpc_dev.toy import build_toy_target\n")
    (tmp_path / "hpc" / "model" / "ok.py").write_text("from hpc.config import resolve\nimport torch\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        found = violations("hpc")
    finally:
        ROOT = saved
    assert [v.split(": ")[-1] for v in found] == ["against the layer order",
                                                  "production code never imports development tooling"]


@pytest.mark.parametrize("pkg", [p for layer in LAYERS for p in layer])
def test_each_layer_package_exists(pkg):
    rel = Path(*pkg.split("."))
    assert (ROOT / rel).is_dir() or (ROOT / rel).with_suffix(".py").is_file(), pkg


def _imported_modules(path: Path) -> set[str]:
    """Every module an import in `path` runs: `from pkg import mod` runs pkg and pkg.mod."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def import_cycles(top: str = "hpc") -> list[list[str]]:
    """Groups of modules that import each other, directly or round a loop (any import counts:
    module level, inside a function, or under TYPE_CHECKING). Tarjan's strongly connected
    components, each with more than one module."""
    modules = dict((m, p) for p, m in _modules(top))
    graph = {m: sorted({n for n in _imported_modules(p) if n in modules and n != m}) for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))
    for m in sorted(graph):
        if m not in index:
            visit(m)
    return sorted(found)


def test_no_module_imports_itself_round_a_loop():
    assert import_cycles("hpc") == [] and import_cycles("hpc_dev") == []


def test_the_cycle_check_finds_a_loop_through_a_function_level_import(tmp_path):
    (tmp_path / "hpc" / "model").mkdir(parents=True)
    (tmp_path / "hpc" / "model" / "a.py").write_text("from hpc.model.b import f\n")
    (tmp_path / "hpc" / "model" / "b.py").write_text("def f():\n    from hpc.model.c import g\n")
    (tmp_path / "hpc" / "model" / "c.py").write_text("from hpc.model import a\n")
    (tmp_path / "hpc" / "model" / "d.py").write_text("from hpc.model.a import x\n")  # on the way in, not round
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        found = import_cycles("hpc")
    finally:
        ROOT = saved
    assert found == [["hpc.model.a", "hpc.model.b", "hpc.model.c"]]
