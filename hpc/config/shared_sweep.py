"""Which sweeps may share one verifier: every variant must be fed the very samples the others are.

Sharing trains K drafts from one capture stream, so a variant may change how a draft learns
(lr, loss weights, schedule, steps, draft depth and heads) but nothing that changes what the
verifier captures or which rows reach the trainers in which order: the target and its capture
(`verifier.*`), the data (`data.*`, `max_seq_len` included), the stream, the epoch order's seed,
the held-out rows, and the trainers' shape (every group is a DDP world of one size).
"""

from __future__ import annotations

import math
from typing import Any

# What turns the config into one of its sweep's variants: no sweep of its own, and so nothing to share
# (the variant's train job is the shared one when submit.share_verifier is set in the base).
ONE_VARIANT = ("sweep={}", "submit.share_verifier=false")

# (prefix or key, why a variant may not change it), the first that matches a sweep key wins
CAPTURE_KEYS = (
    ("verifier.", "the target and its capture"),
    ("data.", "the rows captured (sources, max_seq_len, regeneration)"),
    ("stream.", "how the samples travel"),
    ("train.seed", "each epoch's sample order, which the streamer follows"),
    ("train.hold_out_every", "which rows are held out from the stream"),
    ("train.device", "the trainers' shape"),
    ("train.dist_backend", "the trainers' shape"),
    ("train.ranks_per_node", "the trainers' shape"),
    ("train.output_dir", "where each variant writes (each gets v<i>/ under it)"),
)


def share_problems(sweep: dict, variants: int) -> list[str]:
    """One line per reason a sweep cannot share the verifier; empty when it can."""
    if variants < 2:
        return [f"sweep: {variants} variant(s); sharing the verifier trains several drafts from one capture, "
                "so give a sweep of at least two values (e.g. 'sweep={train.lr: [3e-4, 1e-4]}')"]
    out = []
    for key in sorted(sweep):
        why = next((w for k, w in CAPTURE_KEYS if key == k or (k.endswith(".") and key.startswith(k))), None)
        if why is not None:
            out.append(f"sweep.{key}: changes {why}, which every draft sharing the verifier must share; "
                       "sweep it without sharing (one allocation per variant), or fix it for the whole sweep")
    return out


def shared_groups(cfg: Any) -> int:
    """How many drafts one train allocation feeds from its verifier: the sweep's variants when
    submit.share_verifier is set, else 1 (each variant then has a verifier of its own)."""
    if not cfg.submit.share_verifier:
        return 1
    return math.prod(len(v) for v in (cfg.sweep or {}).values() if isinstance(v, list)) or 1


def train_nodes(cfg: Any) -> int:
    """The train job's nodes: V verifier nodes and trainer_nodes for each draft it trains."""
    return cfg.cluster.verifier_nodes + cfg.cluster.trainer_nodes * shared_groups(cfg)
