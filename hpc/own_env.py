"""Environment variables this job sets for its own process groups, kept out of vLLM's.

A streamer rank spawns vLLM. vLLM reads LOCAL_RANK (its device choice under torchrun), RANK,
WORLD_SIZE and MASTER_* as if it were a rank of ours, and the NCCL/GLOO settings we chose for
our planes would steer its tensor-parallel communicators too. What we set goes through `set_own`,
which records the name; `foreign_environ` is the environment minus those names and the rank
variables. A site's own NCCL_* settings (set before we ran) pass through; one that vLLM must not
see, or must see differently, goes in `verifier.env`, which is applied last.
"""

from __future__ import annotations

import os

RECORD = "DSPARK_OWN_ENV"  # names set by set_own, comma-separated: children of ours read it too
RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
NCCL_TRACE_PREFIX = "nccl-trace-rank"  # flight-recorder dumps; torch appends the rank (dspark status reads them)
OUR_PREFIXES = ("TORCHELASTIC_", "TORCH_NCCL_")  # torchrun's bookkeeping, our NCCL error handling


def set_own(name: str, value: str, *, default: bool = False) -> None:
    """os.environ[name] = value (only if unset, with `default`), recorded as ours."""
    if default and name in os.environ:
        return
    os.environ[name] = value
    names = {n for n in os.environ.get(RECORD, "").split(",") if n}
    os.environ[RECORD] = ",".join(sorted(names | {name}))


def foreign_environ() -> dict[str, str]:
    """os.environ without our rank variables and what `set_own` recorded."""
    ours = {n for n in os.environ.get(RECORD, "").split(",") if n} | set(RANK_VARS) | {RECORD}
    return {k: v for k, v in os.environ.items() if k not in ours and not k.startswith(OUR_PREFIXES)}
