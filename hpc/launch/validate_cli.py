"""`dspark validate CONFIG [KEY=VALUE ...]`: every problem at once, exit 2 if any.

It lives with the launcher because two checks need what the config package cannot reach: a
drift trigger compares the served draft with the champion's evaluation at the served n, which
must exist (the registry); and each stage must finish in its Slurm time, which takes the
capacity plan and the draft's size (hpc.launch.plan_time)."""

from __future__ import annotations

import argparse
import sys

from omegaconf import OmegaConf

from hpc.config.schema import Trigger
from hpc.config.secrets import redacted
from hpc.config.validate_ops import warn_advisories
from hpc.errors import ConfigError
from hpc.launch.launch_checks import resolve
from hpc.launch.plan import pipeline_problems


def run(args: argparse.Namespace) -> int:
    try:
        cfg = resolve(args.config, args.overrides, check_tracking=not args.offline)
    except ConfigError as err:
        for line in err.problems:
            print(f"error: {line}", file=sys.stderr)
        print(f"{len(err.problems)} problem(s) in {args.config}", file=sys.stderr)
        return 2

    warn_advisories(cfg)
    late = pipeline_problems(cfg)  # once the config is good: its arithmetic divides by its knobs
    if late:
        for line in late:
            print(f"error: {line}", file=sys.stderr)
        print(f"{len(late)} problem(s) in {args.config}", file=sys.stderr)
        return 2
    if not args.offline and cfg.schedule.trigger != Trigger.cron:
        from hpc.launch.retrain import check_champion  # the registry over REST: only a drift trigger asks it

        if why := check_champion(cfg):
            print(f"error: schedule.trigger = {cfg.schedule.trigger.value}: {why}", file=sys.stderr)
            return 2
    if args.print:
        print(OmegaConf.to_yaml(OmegaConf.structured(redacted(cfg))), end="")
    print(f"ok: {args.config} is valid ({cfg.name})")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="check a config on the login node, before anything is submitted")
    p.add_argument("config", help="YAML config, e.g. configs/kimi-k2.6-dspark.yaml")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotlist overrides, e.g. train.lr=1e-4")
    p.add_argument("--print", action="store_true", help="print the resolved config")
    p.add_argument("--offline", action="store_true",
                   help="skip the checks that ask the tracking server: reachable, and the champion a drift "
                   "trigger compares with")
    p.set_defaults(func=run)
