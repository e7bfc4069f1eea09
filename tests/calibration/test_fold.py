"""The survival (product of slot confidences 1..k) against 'slots 1..k were all accepted'."""

from __future__ import annotations

import math

import pytest
import torch

from hpc.calibration.fit import HeldOutSlots, concat_slots
from hpc.calibration.fold import survival_ece, survival_table


def _slots(conf_NK: torch.Tensor, accept_NK: torch.Tensor, drafted_NK: torch.Tensor | None = None,
           visit_N: torch.Tensor | None = None) -> HeldOutSlots:
    N, K = conf_NK.shape
    drafted = drafted_NK if drafted_NK is not None else torch.ones(N, K, dtype=torch.bool)
    visit = visit_N if visit_N is not None else torch.ones(N)
    pos = torch.arange(1, K + 1).expand(N, K)
    block = torch.arange(N)[:, None].expand(N, K)
    reach = visit[:, None].expand(N, K).clone()
    return HeldOutSlots(torch.logit(conf_NK)[drafted], accept_NK.float()[drafted], accept_NK.float()[drafted],
                        pos[drafted], {"greedy": reach[drafted], "sampling": reach[drafted]}, block[drafted])


def test_the_table_multiplies_within_a_block_and_weighs_blocks_by_their_visits():
    conf = torch.tensor([[0.9, 0.5, 0.8], [0.6, 0.7, 0.5]])
    accept = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    drafted = torch.tensor([[True, True, True], [True, True, False]])  # block 1 drafted two slots
    surv, event, weight = survival_table(_slots(conf, accept, drafted, torch.tensor([1.0, 0.25])), "greedy")
    assert torch.allclose(surv[0], torch.tensor([0.9, 0.45, 0.36], dtype=torch.float64))
    assert torch.allclose(surv[1, :2], torch.tensor([0.6, 0.42], dtype=torch.float64))
    assert event.tolist() == [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
    assert weight.tolist() == [[1.0, 1.0, 1.0], [0.25, 0.25, 0.0]]


def test_blocks_of_concatenated_halves_stay_apart():
    half = _slots(torch.full((2, 2), 0.5), torch.ones(2, 2))
    surv, _, weight = survival_table(concat_slots([half, half]), "greedy")
    assert surv.shape == (4, 2) and torch.allclose(surv[:, 1], torch.full((4,), 0.25, dtype=torch.float64))


def test_a_head_calibrated_per_slot_has_a_calibrated_survival_and_an_overconfident_one_compounds():
    gen = torch.Generator().manual_seed(0)
    conf = torch.tensor([0.2, 0.5, 0.8, 0.95])[torch.randint(0, 4, (4000, 4), generator=gen)]
    accept = (torch.rand(conf.shape, generator=gen) < conf).float()
    fair = survival_ece(_slots(conf, accept), "greedy", floors=True)
    assert all(ece < floor + 0.02 for ece, _, floor in fair)
    assert fair[0][1] == fair[3][1] == 4000  # every block drafted every slot: no conditioning on reach
    bold = survival_ece(_slots((conf + 0.04).clamp(max=0.99), accept), "greedy", floors=True)
    assert all(ece > floor + 0.02 for ece, _, floor in bold)


def test_slots_without_block_ids_are_refused():
    s = _slots(torch.full((2, 2), 0.5), torch.ones(2, 2))
    with pytest.raises(ValueError, match="block ids"):
        survival_table(HeldOutSlots(s.logit, s.greedy, s.sampling, s.position, s.reach), "greedy")


def test_a_k_that_decoding_never_reaches_is_nan_not_zero():
    conf, accept = torch.full((2, 3), 0.5), torch.ones(2, 3)
    drafted = torch.tensor([[True, True, True], [True, False, False]])
    # Only the block decoding never drafts (visit 0) has a third slot.
    third = survival_ece(_slots(conf, accept, drafted, torch.tensor([0.0, 1.0])), "greedy")[2]
    assert math.isnan(third[0]) and third[1] == 0.0
