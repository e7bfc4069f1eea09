"""The calibration report against hand-computed numbers."""

from __future__ import annotations

import json
import random

import pytest

from hpc.errors import UserError
from hpc.evaluate.confidence_report import calibration_png, calibration_report, format_report


def test_perfect_calibration_has_zero_ece():
    # Position 1: conf 0.75 right 3 times in 4, conf 0.25 right once in 4.
    steps = [([0.75], [m]) for m in (1, 1, 1, 0)] + [([0.25], [m]) for m in (1, 0, 0, 0)]
    pos = calibration_report({"gsm8k": steps})["positions"][0]
    assert pos["count"] == 8 and pos["ece"] == pytest.approx(0.0)
    # Brier: per group 3 * 0.25^2 + 0.75^2 = 0.75, over 8 steps.
    assert pos["brier"] == pytest.approx(1.5 / 8)
    assert pos["bins"][7] == {"lo": 0.7, "hi": 0.8, "count": 4, "conf": 0.75, "acc": 0.75}


def test_constant_overconfident_head():
    # Always 0.9, right half the time where reached: ECE |0.5 - 0.9|, Brier (0.1^2 + 0.9^2) / 2.
    # Position 2 is judged only in the two steps whose first draft was accepted.
    steps = [([0.9, 0.9], [1, 1]), ([0.9, 0.9], [1, 0]), ([0.9, 0.9], [0, 0]), ([0.9, 0.9], [0, 0])] * 5
    report = calibration_report({"math500": steps})
    assert report["n_max"] == 2
    for pos in report["positions"]:
        assert pos["ece"] == pytest.approx(0.4)
        assert pos["brier"] == pytest.approx(0.41)
        assert pos["mean_conf"] == pytest.approx(0.9) and pos["accuracy"] == pytest.approx(0.5)


def test_positions_count_only_steps_that_reached_them():
    steps = [([0.9, 0.8, 0.7], [1, 0, 0]), ([0.6], [0])]
    report = calibration_report({"aime": steps, "humaneval": [([0.5, 0.5], [1, 1])]})
    # Position 3 was drafted once, after a miss at 2: drafted, never judged.
    assert [p["count"] for p in report["positions"]] == [3, 2, 0]
    aime = report["benchmarks"]["aime"]
    # n=3 replays [1,0,0] -> 1 accepted and [0] -> 0; drafted 3 and 1.
    assert aime["full"]["expected_accepted"] == pytest.approx(0.5)
    assert aime["full"]["mean_drafted"] == pytest.approx(2.0)


def test_n2_beats_n3_under_the_draft_cost():
    steps = [([0.9, 0.8, 0.4], [1, 1, 0])] * 10
    b = calibration_report({"gsm8k": steps}, cost=0.03)["benchmarks"]["gsm8k"]
    objectives = {f["n"]: f["objective"] for f in b["fixed_n"]}
    assert objectives == pytest.approx({1: 2 / 1.03, 2: 3 / 1.06, 3: 3 / 1.09})
    assert b["best_n"]["n"] == 2 and b["best_n"]["expected_accepted"] == pytest.approx(2.0)
    assert b["full"]["n"] == 3 and b["full"]["objective"] == pytest.approx(3 / 1.09)
    # Free drafting: the third position costs nothing, so the tie goes to the smaller n.
    assert calibration_report({"gsm8k": steps}, cost=0.0)["benchmarks"]["gsm8k"]["best_n"]["n"] == 2


def test_a_threshold_beats_every_fixed_n():
    # Confident steps are right at all 3 positions, unsure ones wrong at once: stopping
    # the unsure ones after 1 token keeps every accepted token for fewer drafted ones.
    good, bad = ([0.9, 0.9, 0.9], [1, 1, 1]), ([0.3, 0.3, 0.3], [0, 0, 0])
    b = calibration_report({"livecodebench": [good, bad] * 4}, cost=0.03)["benchmarks"]["livecodebench"]
    fixed = {f["n"]: f["objective"] for f in b["fixed_n"]}
    assert fixed == pytest.approx({1: 1.5 / 1.03, 2: 2.0 / 1.06, 3: 2.5 / 1.09})
    best = b["best_threshold"]
    # t=0.05 keeps 2 of the unsure ones (0.09 >= 0.05); t=0.10 is the first to keep 1 (0.09 < 0.10).
    by_t = {t["threshold"]: t["objective"] for t in b["thresholds"]}
    assert by_t[0.05] == pytest.approx(2.5 / 1.075)
    assert best["threshold"] == 0.1
    assert best["objective"] == pytest.approx(2.5 / 1.06)
    assert best["expected_accepted"] == pytest.approx(1.5) and best["mean_drafted"] == pytest.approx(2.0)
    assert best["objective"] > max(fixed.values())
    # Above 0.729 (= 0.9^3) the confident steps lose their third token.
    assert by_t[0.75] == pytest.approx(2.0 / 1.045)


def test_report_is_json_and_printable(tmp_path):
    steps = {"gsm8k": [([0.9, 0.5], [1, 0]), ([0.2, 0.1], [0, 1])], "aime": []}
    report = calibration_report(steps)
    assert json.loads(json.dumps(report)) == report
    text = format_report(report)
    assert "ECE" in text and "gsm8k" in text and "t=" in text
    assert text.splitlines()[-1].startswith("aime") and text.splitlines()[-1].endswith("-")


def test_png_is_a_valid_png(tmp_path):
    steps = {"gsm8k": [([0.9, 0.7, 0.4], [1, 1, 0]), ([0.3, 0.2, 0.1], [0, 0, 1])] * 3}
    out = calibration_png(calibration_report(steps), tmp_path / "plots" / "calibration.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and b"IEND" in data[-12:]
    assert [p.name for p in out.parent.iterdir()] == ["calibration.png"]  # no temp file left behind


@pytest.mark.parametrize("steps, cost, match", [
    ({"gsm8k": [([0.5, 0.5], [1])]}, 0.03, "2 confidences and 1 matches"),
    ({"gsm8k": [([1.5], [1])]}, 0.03, r"\[0, 1\]"),
    ({"gsm8k": []}, 0.03, "no verify steps"),
    ({"gsm8k": [([0.5], [1])]}, -1.0, "draft_token_cost"),
])
def test_bad_input_is_a_user_error(steps, cost, match):
    with pytest.raises(UserError, match=match):
        calibration_report(steps, cost)


def test_the_ece_floor_is_the_noise_of_a_calibrated_head_and_shrinks_with_the_count():
    from hpc.evaluate.confidence_report import ece_floor

    few, many = ece_floor([0.5] * 50), ece_floor([0.5] * 5000)
    # |mean of n Bernoulli(0.5) - 0.5| has mean sqrt(0.25 / n) * sqrt(2 / pi): 0.056 at n = 50
    assert 0.03 < few < 0.09 and many < few / 5
    assert ece_floor([0.0] * 40 + [1.0] * 40) == 0.0  # certain events: no noise at all
    assert ece_floor([]) == 0.0 and ece_floor([0.3] * 60) == ece_floor([0.3] * 60)  # seeded


def test_perfect_head_eces_are_the_floors_draws_sorted():
    from hpc.evaluate.confidence_report import ece_floor, perfect_head_eces

    eces = perfect_head_eces([0.3] * 60)
    assert len(eces) == 200 and eces == sorted(eces) and eces[0] < eces[-1]
    assert abs(sum(eces) / len(eces) - ece_floor([0.3] * 60)) < 1e-12


def test_survival_is_the_product_against_all_accepted():
    # Two slots, each said 0.9 and each accepted half the time, independently: every slot is
    # 0.4 overconfident, and the survival of both (0.81 said, 0.25 accepted) is off by 0.56.
    steps = [([0.9, 0.9], [a, b]) for a in (0, 1) for b in (0, 1)] * 25
    report = calibration_report({"b": steps}, bins=10)
    s1, s2 = report["survival"]
    assert s1["count"] == s2["count"] == 100  # every step drafted both: no conditioning on reach
    assert s1["ece"] == pytest.approx(0.4)
    assert s2["mean_conf"] == pytest.approx(0.81) and s2["accuracy"] == pytest.approx(0.25)
    assert s2["ece"] == pytest.approx(0.56)
    assert report["positions"][1]["ece"] == pytest.approx(0.4)  # the slot ECE misses the compounding
    assert "survival ECE" in format_report(report)


def test_a_head_calibrated_per_slot_has_a_calibrated_survival():
    # Each slot accepted with the chance it states, independently: the survival is calibrated
    # too, so its ECE stays near its floor while an overconfident head's does not.
    rng = random.Random(5)
    steps = []
    for _ in range(1500):
        confs = [rng.choice([0.2, 0.5, 0.8, 0.95]) for _ in range(4)]
        steps.append((confs, [int(rng.random() < c) for c in confs]))
    survival = calibration_report({"b": steps})["survival"]
    assert all(s["ece"] < s["ece_floor"] + 0.02 for s in survival)
    over = [([min(1.0, c + 0.15) for c in confs], m) for confs, m in steps]
    assert all(s["ece"] > 0.05 for s in calibration_report({"b": over})["survival"][1:])
