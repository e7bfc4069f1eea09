"""The ratio of two drafts' tau with its bootstrap interval over prompts (issue 48, item 7): paired
draws, by-hand figures, the seeds' mean, and what it refuses to compare."""

from __future__ import annotations

import numpy as np
import pytest

from hpc.evaluate import ratios as br
from hpc.evaluate.harness import BenchResult


def result(label: str, bench: str, per_prompt: list[list[int]], n: int = 7) -> BenchResult:
    steps, acc = (sum(c) for c in zip(*per_prompt))
    return BenchResult(bench, len(per_prompt), "x", "fixture", "vllm", label, "dspark", n, 1.0, 0, 1.0, 16,
                       verify_steps=steps, accepted_tokens=acc, accept_len=1 + acc / steps, per_prompt=per_prompt)


def table(counts: dict[str, dict[str, list[list[int]]]]) -> dict:
    return br.prompt_table({lab: [result(lab, b, pp) for b, pp in by.items()] for lab, by in counts.items()})


def noisy(rng: np.random.Generator, prompts: int, accept: float) -> list[list[int]]:
    steps = rng.integers(5, 15, prompts)
    return [[int(s), int(rng.binomial(7 * s, accept / 7))] for s in steps]


def test_the_point_is_the_ratio_of_benchmark_means_and_the_interval_holds_it():
    # by hand: gsm8k DSpark (2+4)/(2+2) -> tau 2.5, DFlash 2/4 -> 1.5; humaneval 3/3 -> 2.0 vs 1/2 -> 1.5
    t = table({"DSpark": {"gsm8k": [[2, 2], [2, 4]], "humaneval": [[3, 3]]},
               "DFlash": {"gsm8k": [[2, 1], [2, 1]], "humaneval": [[2, 1]]}})
    iv = br.ratio_interval([t], "DSpark", "DFlash", 7)
    assert iv is not None and iv.per_seed == pytest.approx(((2.5 + 2.0) / 2 / 1.5,))
    assert iv.lo <= iv.ratio <= iv.hi and iv.prompts == 3


def test_same_answers_give_a_zero_width_interval_the_draw_is_paired():
    rng = np.random.default_rng(1)
    same = {"gsm8k": noisy(rng, 20, 2.0), "humaneval": noisy(rng, 20, 1.0)}
    iv = br.ratio_interval([table({"DSpark": same, "ngram": same})], "DSpark", "ngram", 7)
    assert (iv.lo, iv.ratio, iv.hi) == pytest.approx((1.0, 1.0, 1.0))  # unpaired draws would spread it


def test_the_interval_narrows_with_prompts_and_separates_a_real_gap():
    rng = np.random.default_rng(2)
    widths = []
    for prompts in (20, 320):
        t = table({"DSpark": {"gsm8k": noisy(rng, prompts, 2.4)}, "DFlash": {"gsm8k": noisy(rng, prompts, 2.0)}})
        iv = br.ratio_interval([t], "DSpark", "DFlash", 7)
        widths.append(iv.hi - iv.lo)
    assert widths[1] < widths[0] / 2  # ~1/sqrt(16) of it
    assert iv.lo > 1.0  # 1 + 2.4 against 1 + 2.0 over 320 prompts: the gap is outside the interval


def test_over_seeds_the_mean_ratio_and_each_seed_on_the_same_draws():
    rng = np.random.default_rng(3)
    seeds = [table({"DSpark": {"gsm8k": noisy(rng, 40, a)}, "DFlash": {"gsm8k": noisy(rng, 40, 2.0)}})
             for a in (2.2, 2.4, 2.6)]
    one = [br.ratio_interval([s], "DSpark", "DFlash", 7) for s in seeds]
    iv = br.ratio_interval(seeds, "DSpark", "DFlash", 7)
    assert iv.per_seed == pytest.approx(tuple(o.ratio for o in one))
    assert iv.ratio == pytest.approx(np.mean(iv.per_seed)) and iv.lo < iv.ratio < iv.hi


def test_different_prompts_are_not_compared():
    rng = np.random.default_rng(4)
    t = table({"DSpark": {"gsm8k": noisy(rng, 10, 2)}, "DFlash": {"gsm8k": noisy(rng, 9, 2)}})
    assert br.ratio_interval([t], "DSpark", "DFlash", 7) is None
    assert br.ratio_interval([t], "DSpark", "Markov-only", 7) is None  # a draft that did not run
