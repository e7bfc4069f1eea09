"""Each metric against a small case worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from hpc.model.metrics import (
    accept_prob,
    brier,
    expected_acceptance_length,
    expected_calibration_error,
    greedy_acceptance,
    mass_outside_draft_vocab,
    mean_acceptance,
    per_position_acceptance,
)


def test_accept_prob_is_one_minus_tv():
    p = torch.tensor([[[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]]])
    q = torch.tensor([[[0.25, 0.25, 0.5], [0.0, 1.0, 0.0]]])
    # min sums: 0.25 + 0.25 + 0 = 0.5 ; 0 + 0 + 0 = 0
    assert accept_prob(p, q).tolist() == [[0.5, 0.0]]


def test_per_position_and_expected_length():
    a = torch.tensor([[0.5, 0.5, 1.0], [1.0, 0.0, 1.0]])
    valid = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # slot means over valid: (0.5+1)/2, (0.5+0)/2, 1/1
    assert per_position_acceptance(a, valid).tolist() == [0.75, 0.25, 1.0]
    # block 1: 0.5 + 0.25 + 0.25 = 1.0 ; block 2: 1 + 0 + 0 = 1.0 ; mean 1.0 -> + bonus = 2.0
    assert expected_acceptance_length(a, valid).item() == pytest.approx(2.0)


def test_mean_acceptance_counts_only_the_slots_it_sums():
    a = torch.tensor([[0.5, 0.25], [0.4, 0.9]])
    valid = torch.tensor([[1, 1], [1, 0]])
    assert mean_acceptance(a, valid).item() == pytest.approx((0.5 + 0.25 + 0.4) / 3)
    assert mean_acceptance(a, torch.zeros_like(valid)).item() == 0.0


def test_greedy_acceptance():
    d = torch.tensor([[[0.1, 2.0], [3.0, 0.0]]])
    t = torch.tensor([[[0.0, 1.0], [0.0, 1.0]]])
    assert greedy_acceptance(d, t).tolist() == [[1.0, 0.0]]


def test_mass_outside_draft_vocab():
    # logits [0, ln 3] -> probs [0.25, 0.75]; keep id 1 only.
    logits = torch.tensor([[0.0, math.log(3.0)]])
    t2d = torch.tensor([False, True])
    assert mass_outside_draft_vocab(logits, t2d).item() == pytest.approx(0.25, abs=1e-6)


def test_brier_and_ece():
    conf = torch.tensor([0.9, 0.9, 0.2, 0.2])
    out = torch.tensor([1.0, 0.0, 0.0, 0.0])
    # Brier: (0.01 + 0.81 + 0.04 + 0.04) / 4
    assert brier(conf, out).item() == pytest.approx(0.225)
    # bins: {0.9,0.9} acc 0.5 -> |0.9-0.5| ; {0.2,0.2} acc 0 -> |0.2-0| ; weights 1/2 each
    assert expected_calibration_error(conf, out).item() == pytest.approx(0.5 * 0.4 + 0.5 * 0.2)


def test_ece_stays_on_the_confidences_device():
    """A CPU accumulator `+=` a CUDA value raises on every GPU training step; the meta device
    stands in for CUDA here: the old accumulator left the result on the CPU."""
    conf = torch.rand(64, device="meta")
    assert expected_calibration_error(conf, conf > 0.5).device.type == "meta"
    assert expected_calibration_error(conf[:0], conf[:0]).device.type == "meta"

