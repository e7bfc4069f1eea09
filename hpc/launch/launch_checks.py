"""Launch's login-node checks (the schedule), after every stage's below: `resolve` here is the
whole of `dspark validate`, and what submit, the stages in a job and the retrain tick resolve with.
"""

from __future__ import annotations

from hpc.config import resolver
from hpc.config.checker import Checker
from hpc.config.schema import DSparkConfig
from hpc.config.validate import CheckContext
from hpc.launch.cron import HINT, parse_cron
from hpc.verifier import verifier_checks


def check_schedule(c: Checker, cfg: DSparkConfig, ctx: CheckContext) -> None:
    c.nonneg("schedule.retries", cfg.schedule.retries)
    cron = cfg.schedule.cron
    if cron is not None:
        try:
            parse_cron(cron)
        except ValueError as err:
            c.fail("schedule.cron", cron, f"{err}; use {HINT}")


CHECKS = (*verifier_checks.CHECKS, check_schedule)
resolve = resolver(CHECKS)
