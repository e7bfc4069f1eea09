"""Draft-vocabulary pruning: the draft predicts over the N most frequent target ids.

Frequencies come from assistant (loss-masked) tokens only, because those are the tokens the
draft must propose; prompt tokens are never drafted. The map these ids become, and its file, is
a format on the lowest floor (`hpc.formats.vocab_map`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from hpc.errors import UserError
from hpc.formats.vocab_map import mapping_from_selected


def count_assistant_tokens(
    samples: Iterable[tuple[torch.Tensor, torch.Tensor]], vocab_size: int
) -> torch.Tensor:
    """Token counts [V] over (token_ids_T, loss_mask_T) pairs, masked tokens only."""
    counts_V = torch.zeros(vocab_size, dtype=torch.int64)
    for ids_T, mask_T in samples:
        kept_T = ids_T[mask_T.bool()].long()
        bad_T = kept_T[(kept_T < 0) | (kept_T >= vocab_size)]
        if bad_T.numel():  # name the offending id: the max may be a valid one when a negative id is bad
            raise UserError(f"token id {int(bad_T[0])} outside the target vocab 0..{vocab_size - 1}")
        counts_V += torch.bincount(kept_T, minlength=vocab_size)
    return counts_V


def select_draft_vocab(counts_V: torch.Tensor, draft_vocab_size: int, fill: bool = False) -> torch.Tensor:
    """The kept target ids, ascending.

    Ranking is by count (descending), ties broken by the smaller id, so the result is a pure
    function of the counts. If fewer than N ids were seen, `fill=False` is an error; with
    `fill=True` the remaining slots take the smallest unseen ids (a documented, deterministic
    rule: unseen ids cost nothing at training time and low ids hold the tokenizer's specials).
    """
    vocab_size = counts_V.numel()
    if draft_vocab_size > vocab_size:
        raise UserError(f"draft vocab {draft_vocab_size} larger than the target vocab {vocab_size}")
    seen = int((counts_V > 0).sum())
    if seen < draft_vocab_size and not fill:
        raise UserError(
            f"only {seen} distinct assistant tokens seen, fewer than draft_vocab_size={draft_vocab_size}; "
            "use more data, lower draft.draft_vocab_size, or allow filling with unseen ids"
        )
    ids_V = torch.arange(vocab_size)
    # Stable sort on id first, then by count: ties keep ascending id order.
    order = torch.argsort(counts_V, descending=True, stable=True)
    chosen = order[:draft_vocab_size]
    return torch.sort(ids_V[chosen]).values


def build_vocab_mapping(
    samples: Iterable[tuple[torch.Tensor, torch.Tensor]], vocab_size: int, draft_vocab_size: int,
    fill: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """counts -> (d2t, t2d, counts): the whole pruning step."""
    counts_V = count_assistant_tokens(samples, vocab_size)
    d2t_D, t2d_V = mapping_from_selected(select_draft_vocab(counts_V, draft_vocab_size, fill), vocab_size)
    return d2t_D, t2d_V, counts_V
