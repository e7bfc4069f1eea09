"""Checks that look at every leaf of a config, whatever section it is in.

Config strings reach generated files that something executes: `#SBATCH` lines, a scrontab
block, shell command lines. A newline in any of them is a new line there, so no string in a
config may hold a control character. Names become file names and job names, so they follow
one safe pattern. A float that is NaN or infinite passes every range check (`nan > 0` and
`nan <= 0` are both false), so those are refused here, once, for every key.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import fields, is_dataclass
from enum import Enum
from typing import Any

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
NAME_RULE = "use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
# Slurm partition/account/qos names, and the memory size syntax of --mem.
SLURM_WORD = re.compile(r"^[A-Za-z0-9_.+-]{1,128}$")
SLURM_MEM = re.compile(r"^\d+[KMGT]?$")
SBATCH_OPTION = re.compile(r"^--[a-z][a-z0-9-]*(=[^\s'\"\\`$;]+)?$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# Counts above these are typos (an extra zero, or a token count typed as a step count).
LIMITS = {"train.steps": 100_000_000, "train.checkpoint_interval": 100_000_000, "train.warmup_steps": 100_000_000,
          "data.regen_max_tokens": 10_000_000, "eval.max_tokens": 10_000_000,
          "cluster.verifier_nodes": 10_000, "cluster.trainer_nodes": 10_000, "cluster.eval_nodes": 10_000,
          "cluster.regenerate_nodes": 10_000, "cluster.gpus_per_node": 64, "train.ranks_per_node": 64}


def leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) for every scalar in a config dataclass, lists as key[i]."""
    if is_dataclass(obj):
        for f in fields(obj):
            yield from leaves(getattr(obj, f.name), f"{prefix}{f.name}.")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, f"{prefix}{k}.")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from leaves(v, f"{prefix.rstrip('.')}[{i}].")
    else:
        yield prefix.rstrip("."), obj


def check_leaves(cfg: Any, fail: Callable[[str, Any, str], None]) -> None:
    for key, value in leaves(cfg):
        if isinstance(value, Enum):
            continue
        if isinstance(value, str) and _CONTROL.search(value):
            fail(key, value, "contains a control character (newline, tab, ...); config strings end up in "
                 "generated job scripts, so write it on one line without them")
        elif isinstance(value, float) and not math.isfinite(value):
            fail(key, value, "must be a finite number")
        elif isinstance(value, int) and not isinstance(value, bool) and key in LIMITS and value > LIMITS[key]:
            fail(key, value, f"implausibly large (more than {LIMITS[key]:,}); check for a typo")
    for key in ("verifier.env", "sweep"):  # free dicts: their keys reach files too
        section = cfg
        for part in key.split("."):
            section = getattr(section, part)
        for k in section:
            if _CONTROL.search(str(k)):
                fail(f"{key}.{k!r}", k, "key contains a control character; remove it")


def check_names(cfg: Any, fail: Callable[[str, Any, str], None]) -> None:
    """Names that become job names, directory and file names, and Slurm options."""
    if not NAME.match(cfg.name or ""):
        fail("name", cfg.name, f"names the pipeline's jobs and directories; {NAME_RULE}")
    for i, d in enumerate(cfg.eval.compare):
        if d.name and not NAME.match(d.name):
            fail(f"eval.compare[{i}].name", d.name, NAME_RULE)
    cl = cfg.cluster
    for key in ("partition", "account", "qos"):
        value = getattr(cl, key)
        if value and not SLURM_WORD.match(value):
            fail(f"cluster.{key}", value, "not a Slurm name; use letters, digits, '_', '.', '+' or '-' "
                 "(see `sacctmgr show assoc user=$USER`)")
    if any(ch.isspace() for ch in cl.log_dir):
        fail("cluster.log_dir", cl.log_dir, "job logs go in #SBATCH/#SCRON lines, which split on spaces; "
             "use a path without whitespace")
    elif "%" in cl.log_dir:  # Slurm expands %u/%j in --output, our jobs' own files would take it literally
        fail("cluster.log_dir", cl.log_dir, "Slurm would expand its % patterns in --output but not in the paths "
             "the jobs share; write the directory out (e.g. $USER's name instead of %u)")
    if cl.mem and not SLURM_MEM.match(cl.mem):
        fail("cluster.mem", cl.mem, "use Slurm's --mem syntax: a number with an optional K/M/G/T suffix, e.g. 200G")
    for i, item in enumerate(cl.sbatch_extra):
        option = item.partition("=")[0]
        if not SBATCH_OPTION.match(item):
            fail(f"cluster.sbatch_extra[{i}]", item, "give one long sbatch option per item, as --key=value or "
                 "--flag, without spaces or shell characters, e.g. --constraint=h200")
        elif option in ("--exclusive", "--mem"):  # submit owns them: two values would reach sbatch
            fail(f"cluster.sbatch_extra[{i}]", item, f"set cluster.{option[2:]} instead")
        elif option in ("--mem-per-cpu", "--mem-per-gpu") and cl.mem:
            fail(f"cluster.sbatch_extra[{i}]", item, f"Slurm refuses {option} beside --mem; set cluster.mem=null too")


def check_repeats(cfg: Any, fail: Callable[[str, Any, str], None]) -> None:
    """Values where each one names a job or a table column: a repeat runs the same job twice."""
    e = cfg.eval
    for key, values in (("eval.num_speculative_tokens", e.num_speculative_tokens), ("eval.benchmarks", e.benchmarks)):
        seen = [v for i, v in enumerate(values) if v in values[:i]]
        if seen:
            fail(key, list(values), f"{seen[0]!r} appears twice; list each value once")
