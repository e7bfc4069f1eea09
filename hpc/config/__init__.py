"""Configuration: typed schema, YAML + dotlist loading, and login-node validation."""

from hpc.config.load import config_hash, flatten, load_config, sweep_overrides, to_object, to_yaml
from hpc.config.schema import DSparkConfig
from hpc.config.validate import validate
from hpc.errors import ConfigError


def resolve(path, overrides=None, check_tracking: bool = True) -> DSparkConfig:
    """Load, type-check and validate; raise ConfigError with every problem found."""
    from hpc.config.load import check_sweep, load_config_collecting

    cfg, problems = load_config_collecting(path, overrides)
    problems += check_sweep(cfg) + validate(to_object(cfg), check_tracking=check_tracking)
    if problems:
        raise ConfigError(problems)
    return to_object(cfg)


__all__ = [
    "DSparkConfig", "ConfigError", "config_hash", "flatten", "load_config", "resolve",
    "sweep_overrides", "to_object", "to_yaml", "validate",
]
