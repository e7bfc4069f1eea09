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
ONE_VARIANT = ("sweep={}", "submit.share_verifier=false", "submit.ablations=false")

# The equal-budget ablations (submit.ablations): what each part of the DSpark recipe buys. Each
# is the base DSpark draft with some heads removed; all train from one capture, at one budget.
DFLASH = ("draft.markov_rank=0", "draft.enable_confidence_head=false", "draft.sample_from_anchor=false",
          "draft.confidence_head_with_markov=false")  # no Markov head, no confidence head: DFlash's layout
MARKOV_ONLY = ("draft.enable_confidence_head=false", "draft.confidence_head_with_markov=false")
ABLATIONS: dict[str, tuple[str, ...]] = {"DSpark": (), "DFlash": DFLASH, "Markov-only": MARKOV_ONLY}
# Adaptive verification ranks drafted tokens by the confidence head, which the two ablations lack:
# their variants do not chain an adaptive evaluation (eval.adaptive applies to DSpark's alone).
NO_HEAD = ("eval.adaptive=false",)

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


def ablation_problems(cfg: Any) -> list[str]:
    """Why submit.ablations cannot train DSpark, DFlash and Markov-only from this config; empty when it can."""
    if not cfg.submit.ablations:
        return []
    if cfg.sweep:
        return [f"submit.ablations: the config also sweeps {', '.join(sorted(cfg.sweep))}; the ablations are one "
                "shared allocation of three drafts, so drop the sweep or submit one pipeline per value"]
    d = cfg.draft
    if d.markov_rank == 0 or not d.enable_confidence_head:
        return [f"submit.ablations: the base draft is not DSpark (draft.markov_rank={d.markov_rank}, "
                f"draft.enable_confidence_head={d.enable_confidence_head}), so its ablations would repeat it; "
                "submit the ablations of a DSpark draft (a Markov head and a confidence head)"]
    return []


def shares_verifier(cfg: Any) -> bool:
    """Whether one train allocation feeds every variant: submit.share_verifier, or the ablations."""
    return bool(cfg.submit.share_verifier or cfg.submit.ablations)


def share_key(cfg: Any) -> str:
    """The key that made the verifier shared, for the lines that refuse a sharing that does not fit."""
    return "submit.ablations" if cfg.submit.ablations else "submit.share_verifier"


def shared_groups(cfg: Any) -> int:
    """How many drafts one train allocation feeds from its verifier: the sweep's variants (or the
    ablations) when the verifier is shared, else 1 (each variant then has a verifier of its own)."""
    if cfg.submit.ablations:
        return len(ABLATIONS)
    if not cfg.submit.share_verifier:
        return 1
    return math.prod(len(v) for v in (cfg.sweep or {}).values() if isinstance(v, list)) or 1


def sweep_label(keys: list[str], texts: list[str]) -> str:
    """A sweep variant's column on the card: `lr=0.001`, by the keys' last parts (whole keys where
    two share one)."""
    tails = [k.rsplit(".", 1)[-1] for k in keys]
    names = [t if tails.count(t) == 1 else k for k, t in zip(keys, tails)]
    return ",".join(f"{n}={t}" for n, t in zip(names, texts))


def train_nodes(cfg: Any) -> int:
    """The train job's nodes: V verifier nodes and trainer_nodes for each draft it trains."""
    return cfg.cluster.verifier_nodes + cfg.cluster.trainer_nodes * shared_groups(cfg)
