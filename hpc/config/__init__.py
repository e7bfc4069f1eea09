"""Configuration: typed schema, YAML + dotlist loading, and login-node validation.

Names load on first use (PEP 562): `hpc.config.schema` is plain dataclasses, and code that
needs only the schema (the planner, `scripts/gpu-check` on a bare GPU image) must not pull
in omegaconf.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from hpc.errors import ConfigError

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from hpc.config.load import config_hash, flatten, load_config, sweep_overrides, to_object, to_yaml
    from hpc.config.schema import DSparkConfig
    from hpc.config.validate import OwnerCheck, validate

_LAZY = {
    "config_hash": "hpc.config.load", "flatten": "hpc.config.load", "load_config": "hpc.config.load",
    "sweep_overrides": "hpc.config.load", "to_object": "hpc.config.load", "to_yaml": "hpc.config.load",
    "DSparkConfig": "hpc.config.schema", "validate": "hpc.config.validate",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hpc.config' has no attribute {name!r}")


def resolve(path, overrides=None, check_tracking: bool = True, runs_here: bool | None = None,
            owners: Sequence[OwnerCheck] = ()) -> DSparkConfig:
    """Load, type-check and validate; raise ConfigError with every problem found.

    `runs_here`: the work runs on this machine (`dspark train`, a stage inside its job), so its
    devices are checked too; None means "when cluster.executor is local". `owners`: the checks
    the stages above make of their own keys; a stage resolves through its own `*_checks.resolve`
    (`hpc.verifier.verifier_checks`, `hpc.launch.launch_checks`), which passes them.
    """
    # omegaconf and the loaders: every hpc.config module imports this package first, and the draft's
    # model code reads hpc.config.target in venvs that have no omegaconf (speculators, vLLM's)
    from omegaconf.errors import OmegaConfBaseException

    from hpc.config.load import check_sweep, load_config_collecting, to_object
    from hpc.config.validate import ranks_per_node, validate

    cfg, problems = load_config_collecting(path, overrides)
    problems += check_sweep(cfg)
    shapes: dict = {}  # the target's shape, read once for the base and every sweep variant
    try:
        typed = to_object(cfg)
    except OmegaConfBaseException as err:  # e.g. ${oc.env:SCRATCH} unset on this node: the list, not a traceback
        line = f"{getattr(err, 'full_key', None) or '?'}: {str(err).splitlines()[0]}"
        raise ConfigError([*problems, *([line] if line not in problems else [])]) from None
    from hpc.config.secrets import remember_secrets  # as above: the package stays free of omegaconf

    remember_secrets(typed)  # before any error line: a secret interpolated into another key is masked there
    base = validate(typed, check_tracking=check_tracking, runs_here=runs_here, shapes=shapes, owners=owners)
    if not problems:
        base += _variant_problems(cfg, set(base), shapes, owners)
    problems += base
    if problems:
        raise ConfigError(problems)
    out = to_object(cfg)

    out.train.ranks_per_node = ranks_per_node(out)  # resolved once: every stage reads the number
    return out


def _variant_problems(cfg: DictConfig, known: set[str], shapes: dict, owners: Sequence[OwnerCheck]) -> list[str]:
    """A sweep value that breaks a range check is named with its variant; checks that hold for
    the base config are not repeated per variant. Each variant is the loaded config plus its
    dotlist, and the target's shape is read once per target: `validate` stays under a second."""
    # as in resolve: the package stays free of omegaconf
    from hpc.config.load import sweep_overrides, to_object, with_overrides
    from hpc.config.validate import validate

    variants = sweep_overrides(cfg)
    if variants == [[]]:
        return []
    out = []
    for i, variant in enumerate(variants):
        vcfg, problems = with_overrides(cfg, variant)
        problems = problems or validate(to_object(vcfg), check_tracking=False, check_vllm=False, shapes=shapes,
                                        owners=owners)
        shown = " ".join(v for v in variant if not v.startswith("eval.label="))  # the keys the user swept
        out += [f"sweep variant {i} ({shown}): {p}" for p in problems if p not in known]
    return out


def resolver(owners: Sequence[OwnerCheck]) -> Callable[..., DSparkConfig]:
    """`resolve` with a stage's checks: `hpc.verifier.verifier_checks.resolve`, `hpc.launch.launch_checks.resolve`."""
    def resolve_with(path, overrides=None, check_tracking: bool = True, runs_here: bool | None = None) -> DSparkConfig:
        return resolve(path, overrides, check_tracking=check_tracking, runs_here=runs_here, owners=owners)

    return resolve_with


__all__ = [
    "DSparkConfig", "ConfigError", "config_hash", "flatten", "load_config", "resolve", "resolver",
    "sweep_overrides", "to_object", "to_yaml", "validate",
]
