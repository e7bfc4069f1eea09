"""The MLflow keys that cross modules are spelt once, in hpc.track.keys."""

from __future__ import annotations

import ast
from pathlib import Path

from hpc.track import keys

ROOT = Path(__file__).resolve().parents[2]


def _strings(path: Path) -> set[str]:
    """The string literals of a module (f-string parts included), docstrings and comments not."""
    tree = ast.parse(path.read_text(), str(path))
    docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    return {n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs}


def test_no_module_spells_a_shared_key_itself():
    shared = {v for k, v in vars(keys).items() if k.isupper() and isinstance(v, str) and "." in v}
    assert keys.STAGE in shared and keys.PARENT_RUN_ID in shared
    spelt = [f"{path.relative_to(ROOT)}: {key}"
             for top in ("hpc", "hpc_dev") for path in sorted((ROOT / top).rglob("*.py"))
             if path != ROOT / "hpc/track/keys.py"
             for s in _strings(path) for key in shared if s == key or f"`{key}`" in s]
    assert not spelt, "import these keys from hpc.track.keys: " + "; ".join(spelt)


def test_metric_keys_are_benchmark_slash_field():
    assert keys.metric("gsm8k", "tok_s") == "gsm8k/tok_s"
    assert (keys.MEAN_ACCEPT_LEN, keys.MEAN_SPEEDUP) == ("mean/accept_len", "mean/speedup")
