"""The model's login-node check: the teacher can reproduce the target's logits.

`hpc.config` checks the target's shape against the config; whether the target's family has a
row in the logit-rule table (hpc/model/families.py), and that row's keys cover the target's
config.json, only the model knows. `resolve` here is `hpc.config.resolve` with this check.
"""

from __future__ import annotations

from hpc.config import resolver
from hpc.config.checker import Checker
from hpc.config.schema import DSparkConfig
from hpc.config.validate import CheckContext
from hpc.model.families import rule_problems


def check_family(c: Checker, cfg: DSparkConfig, ctx: CheckContext) -> None:
    if ctx.shape.read:
        for line in rule_problems(ctx.shape.architectures, ctx.shape.text_config):
            c.fail("verifier.model", cfg.verifier.model, line)


CHECKS = (check_family,)
resolve = resolver(CHECKS)
