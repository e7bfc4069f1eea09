"""Launch's login-node checks (the schedule, a shared verifier's link), after every stage's below: `resolve` here is the
whole of `dspark validate`, and what submit, the stages in a job and the retrain tick resolve with.
"""

from __future__ import annotations

from hpc.config import resolver
from hpc.config.checker import Checker
from hpc.config.schema import DSparkConfig
from hpc.config.shared_sweep import share_key, shared_groups
from hpc.config.validate import CheckContext
from hpc.errors import UserError
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


def check_shared_link(c: Checker, cfg: DSparkConfig, ctx: CheckContext) -> None:
    """A shared verifier sends every sample to each variant: its link must carry the copies at the
    variants' demand (`dspark plan`'s shared-verifier section shows the arithmetic)."""
    if shared_groups(cfg) < 2:
        return
    from hpc.launch.plan import capacity_plan  # the planner: only for a shared sweep

    try:
        shared = capacity_plan(cfg).shared
    except UserError:
        return  # the plan.* knob's own line says what is wrong
    if shared is not None and shared.most_variants_link < shared.variants:
        most = shared.most_variants_link
        c.fail(share_key(cfg), True,
               f"{shared.variants} variants: the verifier's link (plan.link_gbps={cfg.plan.link_gbps:g}) carries "
               f"each sample {shared.variants} times and feeds at most {most} variant(s)' trainers at their demand; "
               + ("sweep fewer values" if most >= 2 else "sharing does not pay on this link")
               + ", or set submit.share_verifier=false (a verifier per variant)")


CHECKS = (*verifier_checks.CHECKS, check_schedule, check_shared_link)
resolve = resolver(CHECKS)
