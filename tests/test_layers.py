"""Imports go one way: down the dependency graph that docs/layout.md draws.

Every dependency of a module in hpc/ must be allowed by DEPENDS: an `import` (module level or
inside a function: a lazy import is still a dependency) and a module named in a string (the
command tables' "module:function", `import_module`). DEPENDS is a partial order, not a stack
of layers: a package may use what it names and, through them, what they name; two packages
neither reaches (stream and model, track and model) stay independent. Development tooling
(hpc_dev, the `dspark-dev` command) sits above all of it, and hpc never names it, not even in
a string or a comment.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package -> the packages it uses directly. Its allowed dependencies are everything reachable.
DEPENDS: dict[str, set[str]] = {
    "hpc.__main__": {"hpc.cli"},  # `python -m hpc`
    # the command line: tables naming every command and benchmark by module
    "hpc.cli": {"hpc.bench", "hpc.launch"},
    "hpc.bench": {"hpc.launch", "hpc.stream", "hpc.watch"},
    # the Slurm launcher: submit, stages, status, schedule, plan
    "hpc.launch": {"hpc.calibration", "hpc.train", "hpc.tables", "hpc.watch"},
    # the serving watch: live spec-decode counters against the champion's evaluation
    "hpc.watch": {"hpc.evaluate", "hpc.track"},
    # the calibrate stage and the fits it runs: the draft over captured rows, as training runs it
    "hpc.calibration": {"hpc.train"},
    "hpc.train": {"hpc.data", "hpc.stream", "hpc.track", "hpc.own_env"},  # the trainer (online: verifier + stream + DDP)
    # the training data: sources, tokenising, vocab, regeneration by the target, calibration rows
    "hpc.data": {"hpc.verifier"},
    # spec-decode evaluation, compare, the served confidences' report
    "hpc.evaluate": {"hpc.verifier", "hpc.track"},
    "hpc.verifier": {"hpc.stream", "hpc.model", "hpc.proc", "hpc.own_env"},  # vLLM / HF capture
    "hpc.stream": {"hpc.dist", "hpc.net", "hpc.tables"},  # streamer -> trainer transport; Capture, MicroBatch
    "hpc.track": {"hpc.config", "hpc.proc", "hpc.net"},  # MLflow
    "hpc.model": {"hpc.config", "hpc.tables"},  # the draft, its loss, export
    "hpc.config": {"hpc.formats"},  # schema, loading, login-node validation
    # what one stage writes and another reads: the draft's config.json args, the vocab map, the
    # calibration maps, the checkpoint layout, the benchmark manifests. No torch at import.
    "hpc.formats": {"hpc.errors", "hpc.fsio", "hpc.hub"},
    "hpc.dist": {"hpc.errors", "hpc.own_env"},  # the NCCL-rules checker and the two planes
    "hpc.proc": {"hpc.errors", "hpc.proc_guard"},  # a server in a subprocess (VLLMServer, MlflowServer)
    **{leaf: set() for leaf in ("hpc", "hpc.errors", "hpc.fsio", "hpc.net", "hpc.tables", "hpc.proc_guard",
                                "hpc.own_env", "hpc.hub")},
}
MODULE_NAME = re.compile(r"^(hpc(?:_dev)?(?:\.\w+)+)(?::\w+)?$")  # "hpc.x.y" or "hpc.x.y:function"


def reachable(depends: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for pkg in depends:
        seen, todo = set(), list(depends[pkg])
        while todo:
            d = todo.pop()
            if d not in seen:
                seen.add(d)
                todo += depends.get(d, set())
        out[pkg] = seen
    return out


def _package(module: str) -> str:
    """The node of DEPENDS `module` belongs to: its package, or a module that is a node itself."""
    node = next((n for n in DEPENDS if n.count(".") > 1 and (module == n or module.startswith(f"{n}."))), None)
    if node is not None:
        return node
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def _imports(path: Path, module: str) -> list[tuple[int, str]]:
    """Modules `path` depends on: its imports and the module names in its strings."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from hpc import x` imports the module hpc.x
            found += [(node.lineno, f"{node.module}.{a.name}" if node.module in ("hpc", "hpc_dev") else node.module)
                      for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and (m := MODULE_NAME.match(node.value)):
            found.append((node.lineno, m.group(1)))
    return [(line, name) for line, name in found if name.split(".")[0] in ("hpc", "hpc_dev")]


def _modules(top: str) -> list[tuple[Path, str]]:
    out = []
    for path in sorted((ROOT / top).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out.append((path, ".".join(parts[:-1] if parts[-1] == "__init__" else parts)))
    return out


def _allowed(module: str) -> set[str]:
    pkg = _package(module)
    if pkg not in DEPENDS:
        raise AssertionError(f"{module}: its package has no entry in tests/test_layers.py DEPENDS; add it there "
                             f"and to docs/layout.md")
    return reachable(DEPENDS)[pkg]


def violations(top: str = "hpc") -> list[str]:
    bad = []
    for path, module in _modules(top):
        rel = path.relative_to(ROOT)
        if top == "hpc":
            for n, text in enumerate(path.read_text().splitlines(), 1):
                if "hpc_dev" in text:
                    bad.append(f"{rel}:{n} names hpc_dev: production code never names development tooling")
        for line, name in _imports(path, module):
            where = f"{rel}:{line} imports {name}"
            if name.startswith("hpc_dev"):
                if top == "hpc":
                    continue  # said above, for the line
            elif top == "hpc" and _package(name) != _package(module) and _package(name) not in _allowed(module):
                bad.append(f"{where}: not among {_package(module)}'s dependencies (tests/test_layers.py DEPENDS)")
            elif top == "hpc_dev" and _package(name) not in DEPENDS:
                bad.append(f"{where}: no such package in tests/test_layers.py DEPENDS")
    return bad


def test_production_imports_follow_the_dependency_graph():
    assert violations("hpc") == []


def test_dev_tooling_uses_only_known_packages():
    assert violations("hpc_dev") == []


def test_the_dependency_graph_is_a_partial_order():
    """No package reaches itself, every named package exists, and the graph is not a chain."""
    closure = reachable(DEPENDS)
    assert [p for p, r in closure.items() if p in r] == []
    assert {d for ds in DEPENDS.values() for d in ds} <= set(DEPENDS)
    assert "hpc.model" not in closure["hpc.stream"] and "hpc.stream" not in closure["hpc.model"]


def test_every_module_has_a_package_in_the_graph():
    for _, module in _modules("hpc"):
        _allowed(module)


def test_the_check_catches_an_import_against_the_grain(tmp_path):
    (tmp_path / "hpc" / "model").mkdir(parents=True)
    (tmp_path / "hpc" / "model" / "bad.py").write_text(
        "import importlib\n"
        "def f():\n    from hpc.train.trainer import Trainer\n    from hpc.stream.sample import Capture\n"
        "TABLE = [('x', 'hpc.launch.submit:register')]\n"
        "def g():\n    return importlib.import_module('hpc_dev.toy')  # the toy\n")
    (tmp_path / "hpc" / "model" / "ok.py").write_text(
        "from hpc.config import resolve\nimport torch\nNAME = 'hpc.tables'\nTEXT = 'hpc is the package'\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        found = violations("hpc")
    finally:
        ROOT = saved
    assert [v.split(": ")[0].split(" imports ")[-1] for v in found] == [
        "hpc/model/bad.py:7 names hpc_dev", "hpc.train.trainer", "hpc.stream.sample", "hpc.launch.submit"], found


@pytest.mark.parametrize("pkg", sorted(DEPENDS))
def test_each_package_in_the_graph_exists(pkg):
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


def shared_module_names(tops: tuple[str, ...] = ("hpc", "hpc_dev")) -> dict[str, list[str]]:
    """File names that more than one package uses (`__init__`/`__main__` aside): a name must say
    what its module holds, and `cli.py` in six packages says only that it parses arguments."""
    where: dict[str, list[str]] = {}
    for top in tops:
        for path, module in _modules(top):
            if path.stem not in ("__init__", "__main__"):
                where.setdefault(path.stem, []).append(module)
    return {name: mods for name, mods in sorted(where.items()) if len(mods) > 1}


def test_no_two_modules_share_a_name():
    assert shared_module_names() == {}


def test_the_name_check_finds_a_shared_name(tmp_path):
    for pkg in ("model", "train"):
        (tmp_path / "hpc" / pkg).mkdir(parents=True)
        (tmp_path / "hpc" / pkg / "cli.py").write_text("")
    (tmp_path / "hpc" / "train" / "__init__.py").write_text("")
    (tmp_path / "hpc" / "__init__.py").write_text("")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        found = shared_module_names(("hpc",))
    finally:
        ROOT = saved
    assert found == {"cli": ["hpc.model.cli", "hpc.train.cli"]}


def unexplained_lazy_imports(top: str) -> list[str]:
    """Imports inside a function with no comment saying why: on the line, or on a comment line
    right above it or above the block of imports it opens with."""
    found = []
    for path, _ in _modules(top):
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines))
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                i = node.lineno - 1
                said = any("#" in lines[j] for j in range(i, node.end_lineno))
                while not said and i > 0:
                    above = lines[i - 1].strip()
                    if above.startswith("#"):
                        said = True
                    elif above.startswith(("import ", "from ")) or (
                            not above and i > 1 and lines[i - 2].strip().startswith(("import ", "from "))):
                        i -= 1  # the block goes on: an import, or the blank line between its groups
                        continue
                    break
                if not said:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return found


def test_every_import_left_inside_a_function_says_why():
    """A module's header shows what it depends on: an import stays inside a function only to keep
    a heavy or optional dependency off the paths that do not need it, and its comment says which."""
    assert unexplained_lazy_imports("hpc") == [] and unexplained_lazy_imports("hpc_dev") == []


def test_the_lazy_import_check_wants_a_reason(tmp_path):
    (tmp_path / "hpc").mkdir()
    (tmp_path / "hpc" / "m.py").write_text(
        "def a():\n    import torch\n"
        "def b():\n    import mlflow  # seconds to import\n"
        "def c():\n    # torch and safetensors: not on the login node\n"
        "    import torch\n    from safetensors import safe_open\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        found = unexplained_lazy_imports("hpc")
    finally:
        ROOT = saved
    assert found == ["hpc/m.py:2: import torch"]


# What the draft's own modules may import: they also run in venvs we do not build (speculators'
# for the parity tests, vLLM's where a draft is loaded beside the engine), which have torch and
# safetensors but none of our command-line stack.
FOREIGN_VENV_MODULES = ("hpc.formats.draft_args", "hpc.model.blocks", "hpc.model.dspark", "hpc.model.export",
                        "hpc.model.loss", "hpc.model.teacher", "hpc.formats.calibration",
                        "hpc.formats.vocab_map")
NOT_IN_FOREIGN_VENVS = ("omegaconf", "yaml", "mlflow", "rich", "croniter", "submitit", "ray", "transformers")


def test_the_draft_imports_without_our_command_line_stack():
    import subprocess
    import sys

    probe = (f"import sys\nfor m in {NOT_IN_FOREIGN_VENVS!r}: sys.modules[m] = None  # import m raises\n"
             + "".join(f"import {m}\n" for m in FOREIGN_VENV_MODULES))
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]


def test_every_module_a_script_imports_exists():
    """scripts/ holds Python run by path (gpu-check on a bare GPU image): its imports are seen by no
    import of the package, so a module that moved must be found here, not on the device."""
    import importlib.util

    missing = []
    for path in sorted((ROOT / "scripts").iterdir()):
        if not path.is_file() or not path.read_text(errors="replace").startswith("#!/usr/bin/env python"):
            continue
        for line, name in _imports(path, "scripts"):
            if importlib.util.find_spec(name.split(":")[0]) is None:
                missing.append(f"{path.relative_to(ROOT)}:{line} imports {name}, which does not exist")
    assert missing == []
