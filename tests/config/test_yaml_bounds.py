"""A config is bounded in bytes and in values once its YAML aliases expand: past either, one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc.config.load import load_config
from hpc.config.yaml_bounds import MAX_BYTES, MAX_NODES
from hpc.errors import UserError

ROOT = Path(__file__).resolve().parents[2]


def _laughs(levels: int, width: int = 9) -> str:
    """The "billion laughs": each level a list of `width` aliases of the level before (4 KB at 9)."""
    lines = [f"l0: &l0 [{', '.join(['lol'] * width)}]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_is_one_line_before_anything_is_built(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(_laughs(9))
    assert len(bomb.read_bytes()) < 4096
    with pytest.raises(UserError, match=rf"expands to over {MAX_NODES:,} values once its YAML aliases") as err:
        load_config(bomb)
    assert "\n" not in str(err.value) and str(bomb) in str(err.value)


def test_a_recursive_alias_is_refused(tmp_path):
    loop = tmp_path / "loop.yaml"
    loop.write_text("train: &t {lr: 1.0e-4, again: *t}\n")
    with pytest.raises(UserError, match="expands to over"):
        load_config(loop)


def test_an_alias_bomb_in_an_override_is_one_problem_line():
    inner = "[" + ", ".join(["1"] * 10) + "]"
    levels = [f"&l0 {inner}"] + [f"&l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]" for i in range(1, 6)]
    bomb = "[" + ", ".join(levels) + "]"  # one flow line, 10**6 values
    with pytest.raises(UserError, match=r"override `train.lr` expands to over"):
        load_config(ROOT / "configs/toy-cpu.yaml", [f"train.lr={bomb}"])
    small = f"[&a {inner}, *a]"  # aliases within the bound are YAML as usual
    with pytest.raises(UserError, match="train.lr"):  # refused for its type, not its size
        load_config(ROOT / "configs/toy-cpu.yaml", [f"train.lr={small}"])


def test_a_config_over_the_byte_bound_is_refused_unread(tmp_path):
    big = tmp_path / "big.yaml"
    with big.open("w") as fh:
        fh.write("train: {lr: 1.0e-4}\n")
        fh.write(("# " + "x" * 1000 + "\n") * (MAX_BYTES // 1000 + 1))
    with pytest.raises(UserError, match=rf"big.yaml is [\d,]+ bytes, over the {MAX_BYTES:,} a config may have"):
        load_config(big)


@pytest.mark.parametrize("name", ["toy-cpu.yaml", "kimi-k2.6-dspark.yaml"])
def test_the_shipped_configs_are_far_inside_the_bounds(name):
    import yaml

    from hpc.config.yaml_bounds import expanded_size

    text = (ROOT / "configs" / name).read_text()
    assert len(text) < MAX_BYTES // 10 and expanded_size(yaml.compose(text)) < MAX_NODES // 10
    load_config(ROOT / "configs" / name)
