"""The config checks its own keys; a stage above checks the keys only it understands, and hands
`resolve` those checks (`owners`). Each floor's `resolve` carries every check below it, no stage
resolves without its own, and a sweep's variants meet the stages' checks too."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from hpc import config
from hpc.config import ConfigError
from hpc.launch import launch_checks
from hpc.model import model_checks
from hpc.verifier import verifier_checks
from tests.fixtures.recipes import KIMI, NO_VLLM

ROOT = Path(__file__).resolve().parents[2]
FLOORS = {"config": config.resolve, "model": model_checks.resolve, "verifier": verifier_checks.resolve,
          "launch": launch_checks.resolve}


def _unknown_family(tmp_path: Path) -> Path:
    """A target whose shape is Kimi's but whose architecture the logit-rule table lacks."""
    path = tmp_path / "phi"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["PhiForCausalLM"], "model_type": "phi", "num_hidden_layers": 61,
        "hidden_size": 7168, "vocab_size": 163840}))
    return path


def _refused(resolve, overrides: list[str]) -> set[str]:
    """The keys `resolve` refuses under these overrides (empty: it resolves)."""
    try:
        resolve(KIMI, [*NO_VLLM, "cluster.account=a", *overrides], check_tracking=False)
    except ConfigError as err:
        return {p.split(" = ")[0] for p in err.problems}
    return set()


def test_each_floor_refuses_what_its_stages_own_and_what_every_floor_below_owns(tmp_path):
    overrides = [f"verifier.model={_unknown_family(tmp_path)}", "cluster.gpu=h300", "schedule.cron=every tuesday",
                 "train.lr=-1"]
    refused = {floor: _refused(resolve, overrides) for floor, resolve in FLOORS.items()}
    assert refused == {
        "config": {"train.lr"},  # the config's own range check, on every floor
        "model": {"train.lr", "verifier.model"},  # the target's family: no logit rule
        "verifier": {"train.lr", "verifier.model", "cluster.gpu"},  # a GPU vLLM's backends are not known for
        "launch": {"train.lr", "verifier.model", "cluster.gpu", "schedule.cron"},
    }
    assert all(_refused(resolve, []) == set() for resolve in FLOORS.values())  # the recipe itself is good


def test_a_sweep_variant_meets_the_stages_checks(tmp_path):
    problems = []
    try:
        launch_checks.resolve(KIMI, [*NO_VLLM, "cluster.account=a", "sweep={schedule.cron: ['0 3 * * *', 'bad']}"],
                              check_tracking=False)
    except ConfigError as err:
        problems = err.problems
    assert [p.split(": ")[0] for p in problems] == ["sweep variant 1 (schedule.cron=bad)"], problems


def test_the_floors_chain_their_checks():
    assert set(model_checks.CHECKS) <= set(verifier_checks.CHECKS) <= set(launch_checks.CHECKS)
    assert len(set(launch_checks.CHECKS)) == len(launch_checks.CHECKS)  # none runs twice


def test_no_stage_resolves_with_the_configs_own_checks_alone():
    """`hpc.config.resolve` without owners skips every stage's checks: code outside the config
    resolves through a `*_checks.resolve`, which passes them."""
    found = []
    for path in sorted((ROOT / "hpc").rglob("*.py")) + sorted((ROOT / "hpc_dev").rglob("*.py")):
        if path.parent.name == "config":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module == "hpc.config":
                found += [f"{path.relative_to(ROOT)}:{node.lineno}" for a in node.names if a.name == "resolve"]
            elif isinstance(node, ast.Attribute) and node.attr == "resolve" and ast.unparse(node.value) in (
                    "config", "hpc.config"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []


@pytest.mark.parametrize("module", ["hpc.train.train_cli", "hpc.evaluate.evaluate_cli", "hpc.data.regenerate_cli",
                                    "hpc.data.calibration_set", "hpc.watch.watch_bench", "hpc.launch.submit"])
def test_the_stage_commands_resolve_with_the_checks_their_floor_sees(module):
    import importlib

    resolve = importlib.import_module(module).resolve
    assert resolve in (verifier_checks.resolve, launch_checks.resolve)
