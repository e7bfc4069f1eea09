"""Vocabulary pruning: assistant-only counts, deterministic ties, d2t/t2d round trips."""

from __future__ import annotations

import pytest
import torch

from hpc.data.vocab import build_vocab_mapping, count_assistant_tokens, select_draft_vocab
from hpc.errors import UserError
from hpc.formats.vocab_map import check_d2t, mapping_from_selected, selected_from_d2t


def test_counts_only_loss_masked_tokens():
    ids = torch.tensor([1, 1, 2, 3, 3, 3])
    mask = torch.tensor([0, 0, 1, 1, 1, 0])  # the prompt's 1s and the last 3 are not assistant tokens
    counts = count_assistant_tokens([(ids, mask)], vocab_size=5)
    assert counts.tolist() == [0, 0, 1, 2, 0]


def test_top_n_sorted_with_ties_broken_by_smaller_id():
    counts = torch.tensor([0, 5, 3, 5, 3, 1, 3])
    # top 4 by count: 1 (5), 3 (5), then among the 3s ids 2 and 4 win over 6.
    assert select_draft_vocab(counts, 4).tolist() == [1, 2, 3, 4]


def test_d2t_t2d_round_trip():
    selected = torch.tensor([0, 3, 4, 9])
    d2t, t2d = mapping_from_selected(selected, vocab_size=12)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert d2t.tolist() == [0, 2, 2, 6]
    assert torch.equal(selected_from_d2t(d2t), selected)
    assert torch.equal(torch.nonzero(t2d).flatten(), selected)
    check_d2t(d2t, 12)


def test_build_mapping_end_to_end_is_deterministic():
    g = torch.Generator().manual_seed(0)
    samples = [(torch.randint(0, 50, (40,), generator=g), torch.randint(0, 2, (40,), generator=g))
               for _ in range(8)]
    a = build_vocab_mapping(samples, 50, 16)
    b = build_vocab_mapping(list(reversed(samples)), 50, 16)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    d2t, t2d, counts = a
    kept = selected_from_d2t(d2t)
    # Every kept id is at least as frequent as every dropped id.
    assert counts[kept].min() >= counts[~t2d].max()


def test_draft_vocab_larger_than_seen_tokens():
    counts = torch.tensor([0, 4, 0, 2, 0, 0])
    with pytest.raises(UserError, match="only 2 distinct assistant tokens"):
        select_draft_vocab(counts, 4)
    # Documented fill rule: remaining slots take the smallest unseen ids.
    assert select_draft_vocab(counts, 4, fill=True).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("ids,bad", [([0, 7, -1], -1), ([3, 10, 2], 10)])
def test_an_out_of_range_token_is_named(ids, bad):
    from hpc.data.vocab import count_assistant_tokens

    with pytest.raises(UserError, match=f"token id {bad} outside"):
        count_assistant_tokens([(torch.tensor(ids), torch.ones(len(ids)))], vocab_size=10)


@pytest.mark.parametrize("d2t,needle", [
    (torch.tensor([0, 5, 20]), "outside the target vocab"),
    (torch.tensor([3, 1, -2]), "strictly increasing"),
    (torch.tensor([-1, 0]), "outside the target vocab"),
])
def test_bad_d2t_is_rejected(d2t, needle):
    with pytest.raises(UserError, match=needle):
        check_d2t(d2t.long(), vocab_size=10)
