"""Draft-vocabulary pruning: the draft predicts over the N most frequent target ids.

Frequencies come from assistant (loss-masked) tokens only, because those are the tokens the
draft must propose; prompt tokens are never drafted. The mapping follows the speculators /
vLLM convention: `d2t[i] = selected[i] - i` (target_id = i + d2t[i]) and `t2d` a bool mask.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from hpc.errors import UserError


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


def mapping_from_selected(selected_D: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [D] int64 offsets, t2d [V] bool) for ascending kept ids."""
    selected_D = selected_D.long()
    check_selected(selected_D, vocab_size)
    d2t_D = selected_D - torch.arange(selected_D.numel(), dtype=torch.int64)
    t2d_V = torch.zeros(vocab_size, dtype=torch.bool)
    t2d_V[selected_D] = True
    return d2t_D, t2d_V


def selected_from_d2t(d2t_D: torch.Tensor) -> torch.Tensor:
    return torch.arange(d2t_D.numel(), dtype=torch.int64) + d2t_D.long()


def check_selected(selected_D: torch.Tensor, vocab_size: int) -> None:
    if selected_D.numel() == 0:
        raise UserError("empty draft vocabulary")
    if int(selected_D.min()) < 0 or int(selected_D.max()) >= vocab_size:
        raise UserError(
            f"d2t maps draft ids to target ids {int(selected_D.min())}..{int(selected_D.max())}, "
            f"outside the target vocab 0..{vocab_size - 1}; rebuild the vocab for this target"
        )
    if selected_D.numel() > 1 and not bool((selected_D[1:] > selected_D[:-1]).all()):
        raise UserError("d2t does not map to strictly increasing target ids; rebuild the vocab")


def check_d2t(d2t_D: torch.Tensor, vocab_size: int) -> None:
    """A d2t loaded from disk must map into the target vocab, one-to-one."""
    if d2t_D.dtype != torch.int64:
        raise UserError(f"d2t must be int64, got {d2t_D.dtype}")
    check_selected(selected_from_d2t(d2t_D), vocab_size)


def build_vocab_mapping(
    samples: Iterable[tuple[torch.Tensor, torch.Tensor]], vocab_size: int, draft_vocab_size: int,
    fill: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """counts -> (d2t, t2d, counts): the whole pruning step."""
    counts_V = count_assistant_tokens(samples, vocab_size)
    d2t_D, t2d_V = mapping_from_selected(select_draft_vocab(counts_V, draft_vocab_size, fill), vocab_size)
    return d2t_D, t2d_V, counts_V
