"""The isotonic confidence map: the fit by hand, its reading between and beyond knots, its choice
over the Platt map where that bends the wrong way, and the export round trip."""

from __future__ import annotations

import json

import pytest
import torch

from hpc.calibration.fit import HeldOutSlots, concat_slots, cross_fitted_ece, ece_by_position, fit_calibration
from hpc.calibration.isotonic import fit_isotonic
from hpc.errors import UserError
from hpc.formats.calibration import EPS, FILE, Calibration, isotonic_chance, isotonic_logit


def test_pool_adjacent_violators_by_hand():
    # Slots 1 and 2 violate the order (1 then 0): pooled to their weighted mean, 1*1/(1+3) = 0.25,
    # at their weighted mean logit (1*1 + 2*3)/4 = 1.75.
    xs, ps = fit_isotonic(torch.tensor([0.0, 1.0, 2.0, 3.0]), torch.tensor([0.0, 1.0, 0.0, 1.0]),
                          torch.tensor([1.0, 1.0, 3.0, 1.0]))
    assert xs == pytest.approx([0.0, 1.75, 3.0]) and ps == pytest.approx([0.0, 0.25, 1.0])
    # Unsorted input and a zero-weight slot (decoding never reads it) change nothing.
    again = fit_isotonic(torch.tensor([3.0, 2.0, 9.0, 0.0, 1.0]), torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0]),
                         torch.tensor([1.0, 3.0, 0.0, 1.0, 1.0]))
    assert again[0] == pytest.approx(xs) and again[1] == pytest.approx(ps)
    with pytest.raises(ValueError, match="no slot with weight"):
        fit_isotonic(torch.tensor([1.0]), torch.tensor([1.0]), torch.tensor([0.0]))


def test_slots_of_one_logit_are_one_point_of_the_fit(tmp_path):
    """bf16 logits take a few hundred values: slots sharing one must read their pooled mean, not
    the first of several knots at the same logit, and the map must load back once saved."""
    g = torch.Generator().manual_seed(0)
    y = (torch.rand(2000, generator=g) < 0.5).float()
    xs, ps = fit_isotonic(torch.zeros(2000), y, torch.ones(2000))
    assert xs == [0.0] and ps == pytest.approx([float(y.mean())])
    w = torch.rand(3000, generator=g)
    y = (torch.rand(3000, generator=g) < 0.5).float()
    knots = fit_isotonic(torch.full((3000,), 0.1), y, w)
    assert len(knots[0]) == 1 and knots[1][0] == pytest.approx(float((w * y).sum() / w.sum()))
    cal = Calibration({"greedy": [(1.0, 0.0)]}, isotonic={"greedy": {1: knots}})
    assert Calibration.load(cal.save(tmp_path).parent).isotonic == cal.isotonic
    # Two logits, each in many slots: two knots, at those logits.
    z = torch.tensor([0.0, 1.0]).repeat_interleave(1000)
    xs, ps = fit_isotonic(z, (torch.arange(2000) % 4 < torch.where(z > 0, 3, 1)).float(), torch.ones(2000))
    assert xs == pytest.approx([0.0, 1.0]) and ps == pytest.approx([0.25, 0.75])


def test_half_precision_logits_read_finite_logits():
    knots = ([0.0, 1.0, 2.0], [0.0, 0.5, 1.0])
    for dtype in (torch.bfloat16, torch.float16):
        out = isotonic_logit(torch.tensor([-3.0, 1.0, 5.0], dtype=dtype), knots)
        assert out.dtype == dtype and torch.isfinite(out).all() and float(out[1]) == 0.0
    assert isotonic_chance(torch.tensor(0.3), ([1.0], [0.4])).item() == pytest.approx(0.4)  # 0-dim, one knot


def test_the_map_interpolates_between_knots_and_holds_flat_beyond():
    knots = ([0.0, 1.75, 3.0], [0.0, 0.25, 1.0])
    p = isotonic_chance(torch.tensor([-5.0, 0.875, 1.75, 2.375, 10.0]), knots)
    assert p.tolist() == pytest.approx([EPS, 0.125, 0.25, 0.625, 1 - EPS])
    assert isotonic_chance(torch.tensor([[0.0, 9.0]]), ([1.0], [0.3])).flatten().tolist() == pytest.approx([0.3, 0.3])
    # Tied knots (slots of one logit in two runs) read as either end, never as NaN.
    assert not torch.isnan(isotonic_chance(torch.tensor([1.0]), ([1.0, 1.0], [0.2, 0.4]))).any()


def s_shaped(seed: int, n: int = 8000) -> HeldOutSlots:
    """The chance rises steeply through the middle of the head's range and flattens at its ends
    (no sigmoid(a z + b) follows it), centred apart at positions 1 and 2 so each has its own map."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, generator=g) * 2
    position = torch.randint(1, 3, (n,), generator=g)
    chance = 0.5 + 0.4 * torch.tanh(3 * (z - (position - 1).float()))
    y = (torch.rand(n, generator=g) < chance).float()
    ones = torch.ones(n)
    return HeldOutSlots(z, y, chance, position, {"greedy": ones, "sampling": ones})


def test_an_s_shaped_head_gets_an_isotonic_map_that_a_held_out_half_confirms():
    a, b = s_shaped(1), s_shaped(2)
    cal = fit_calibration(concat_slots([a, b]), halves=(a, b))
    assert sorted(cal.isotonic["greedy"]) == [1, 2] and sorted(cal.isotonic["sampling"]) == [1, 2]
    crossed = cross_fitted_ece(a, b, pooled_at=cal.pooled_at,
                               isotonic_at={m: sorted(v) for m, v in cal.isotonic.items()})
    platt_only = cross_fitted_ece(a, b)
    for k in (0, 1):
        assert crossed["greedy"][k][0] < 0.03 < platt_only["greedy"][k][0], (crossed, platt_only)
    # Where the Platt map is right (a linear distortion of the logit), it stays.
    from tests.calibration.test_fit import synthetic_slots

    a, b = synthetic_slots(seed=1), synthetic_slots(seed=2)
    assert fit_calibration(concat_slots([a, b]), halves=(a, b)).isotonic["sampling"] == {}


def test_isotonic_maps_round_trip_through_the_export_file(tmp_path):
    a, b = s_shaped(1), s_shaped(2)
    cal = fit_calibration(concat_slots([a, b]), halves=(a, b))
    back = Calibration.load(cal.save(tmp_path).parent)
    assert back is not None and back.isotonic == cal.isotonic
    z = torch.linspace(-6, 6, 25)
    for mode in ("greedy", "sampling"):
        assert torch.equal(back.apply(z, mode, 1), cal.apply(z, mode, 1))
        assert torch.equal(back.apply(z, mode, 5), cal.apply(z, mode, 2))  # beyond the fitted positions
    both = concat_slots([a, b])
    assert ece_by_position(both, back, "greedy")[0][0] < ece_by_position(both, None, "greedy")[0][0]


def test_an_older_file_without_isotonic_maps_loads_as_platt_only(tmp_path):
    (tmp_path / FILE).write_text(json.dumps({"maps": {"greedy": [[2.0, 1.0]], "sampling": [[1.0, 0.0]]},
                                             "fitted_on": 5}))
    cal = Calibration.load(tmp_path)
    assert cal is not None and cal.isotonic == {}
    assert cal.apply(torch.tensor([1.0]), "greedy", 1).item() == pytest.approx(3.0)


@pytest.mark.parametrize("knots", [[[1.0, 0.0], [0.2, 0.4]], [[0.0], [1.5]], [[], []], [[0.0, 1.0], [0.2]],
                                   [[0.0, float("nan")], [0.2, 0.4]], [[float("-inf"), 0.0], [0.2, 0.4]],
                                   [[0.0, 1.0], [0.6, 0.4]]])
def test_malformed_knots_are_one_line_naming_the_file(tmp_path, knots):
    (tmp_path / FILE).write_text(json.dumps({"maps": {"greedy": [[1.0, 0.0]]}, "isotonic": {"greedy": {"1": knots}}}))
    with pytest.raises(UserError, match="not a confidence calibration"):
        Calibration.load(tmp_path)


@pytest.mark.parametrize("isotonic", [[], {"greedy": [[0.0], [0.5]]}, {"greedy": {"x": [[0.0], [0.5]]}}])
def test_a_malformed_isotonic_section_is_one_line_too(tmp_path, isotonic):
    (tmp_path / FILE).write_text(json.dumps({"maps": {"greedy": [[1.0, 0.0]]}, "isotonic": isotonic}))
    with pytest.raises(UserError, match="not a confidence calibration"):
        Calibration.load(tmp_path)
