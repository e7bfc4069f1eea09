"""Adaptive verification on the reference engine: vLLM's budget and admission rule, kept exact."""

from __future__ import annotations

import pytest
import torch

from hpc.evaluate.adaptive import CostTable, admit, draft_budget, replay_fixed, run_batch
from hpc.evaluate.reference import Decoding, greedy_generate
from tests.evaluate.test_reference import random_draft, random_target

N = 7


def table(verify, draft=((1, 0.0),)) -> CostTable:
    return CostTable(tuple(verify), tuple(draft), "test")


def test_cost_table_interpolates_is_monotone_and_extrapolates():
    t = table([(1, 2.0), (8, 9.0), (16, 5.0), (32, 21.0)], [(1, 1.0), (4, 4.0)])
    assert t.verify(1) == 2.0 and t.verify(0) == 2.0
    assert t.verify(4) == pytest.approx(2.0 + 7.0 * 3 / 7)
    assert t.verify(12) == 9.0  # the dip to 5.0 is read as 9.0: a bigger step never costs less
    assert t.verify(64) == pytest.approx(9.0 + 12.0 * (64 - 16) / 16)  # the last slope, carried on
    assert t.draft(2) == pytest.approx(2.0) and t.step_ms(2, 3) == pytest.approx(2.0 + t.verify(5))


def brute_budget(surv: torch.Tensor, cost: CostTable) -> int:
    R, scores = surv.shape[0], sorted(surv.flatten().tolist(), reverse=True)
    rates = [(R + sum(scores[:k])) / cost.step_ms(R, k) for k in range(len(scores) + 1)]
    return max(range(len(rates)), key=lambda k: (rates[k], -k))


@pytest.mark.parametrize("seed", range(6))
def test_budget_is_the_best_expected_tokens_per_ms(seed):
    g = torch.Generator().manual_seed(seed)
    surv = torch.rand(5, N, generator=g).cumprod(1)
    for cost in (table([(1, 10.0), (64, 10.0)]),  # drafts are free: verify every slot with a chance
                 table([(1, 1.0), (64, 640.0)]),  # each token costs as much as a whole step: none
                 table([(1, 10.0), (8, 11.0), (64, 60.0)], [(1, 2.0), (8, 16.0)])):
        assert draft_budget(surv, cost) == brute_budget(surv, cost)
    assert draft_budget(surv, table([(1, 10.0), (64, 10.0)])) == 5 * N
    assert draft_budget(surv, table([(1, 1.0), (64, 640.0)])) == 0


@pytest.mark.parametrize("seed", range(6))
def test_admission_is_the_global_top_k_and_a_prefix_per_request(seed):
    g = torch.Generator().manual_seed(seed)
    surv = torch.rand(6, N, generator=g).cumprod(1)
    surv[2] = 1.0  # ties inside a request must still admit a prefix
    for budget in (0, 1, 9, 20, 6 * N):
        keep = admit(surv, budget)
        assert sum(keep) == budget and all(0 <= k <= N for k in keep)
        kept = torch.tensor([[j < k for j in range(N)] for k in keep])
        if 0 < budget < 6 * N:
            assert surv[kept].min() >= surv[~kept].max()


def _batch(target, draft, prompts, R, n, cost, adaptive):
    made: list[tuple[Decoding, int]] = []

    def new(ids, max_tokens):
        made.append((Decoding(target, draft, ids, max_tokens, n), max_tokens))
        return made[-1][0]

    traces: list[list[int]] = []
    stats = run_batch(new, prompts, R, n, cost, adaptive, traces)
    return stats, [d.out[:m] for d, m in made], traces


PROMPTS = [([5, 17, 33, 2], 20), ([9, 1, 4], 12), ([40, 41, 42, 43, 44], 25), ([7], 1), ([3, 3, 3], 16)]


@pytest.mark.parametrize("R", [1, 2, 4])
def test_adaptive_decoding_stays_exact_and_admits_within_the_budget(R):
    target = random_target()
    draft = random_draft(target, [1, 2, 3])
    torch.nn.init.normal_(draft.confidence_head.proj.weight, std=2.0)  # confidences that vary
    cost = table([(1, 10.0), (8, 12.0), (32, 30.0)], [(1, 1.0), (8, 8.0)])
    stats, outs, _ = _batch(target, draft, PROMPTS, R, N, cost, adaptive=True)
    for (ids, m), got in zip(PROMPTS, outs):
        assert got == greedy_generate(target, ids, m)
    assert stats.generated == stats.accepted + sum(stats.admitted_hist)
    assert stats.verified == sum(k * c for k, c in enumerate(stats.admitted_hist))
    assert 0 < stats.verified < N * sum(stats.admitted_hist)  # some steps were trimmed, some were not


def test_fixed_n_replayed_at_any_concurrency_equals_decoding_it_batched():
    target = random_target()
    draft = random_draft(target, [1, 2, 3])
    cost = table([(1, 10.0), (8, 12.0), (32, 30.0)], [(1, 1.0), (8, 8.0)])
    one, _, traces = _batch(target, draft, PROMPTS, 1, 3, cost, adaptive=False)
    for R in (1, 3):
        real, _, _ = _batch(target, draft, PROMPTS, R, 3, cost, adaptive=False)
        replayed = replay_fixed(traces, R, 3, cost)
        assert replayed.row() == real.row()  # the same steps, priced in the same order
    assert one.steps > replay_fixed(traces, 3, 3, cost).steps  # three at a time: fewer batched steps


def test_sure_drafts_and_free_verification_admit_every_slot():
    target = random_target()
    draft = random_draft(target, [1, 2, 3])
    torch.nn.init.zeros_(draft.confidence_head.proj.weight)
    torch.nn.init.constant_(draft.confidence_head.proj.bias, 30.0)  # confidence 1.0
    flat = table([(1, 10.0), (256, 10.0)])
    adaptive, _, _ = _batch(target, draft, PROMPTS, 2, N, flat, adaptive=True)
    fixed, _, _ = _batch(target, draft, PROMPTS, 2, N, flat, adaptive=False)
    assert adaptive.row() | {"mode": ""} == fixed.row() | {"mode": ""}


def test_hopeless_drafts_and_dear_tokens_decode_plainly_and_exactly():
    target = random_target()
    draft = random_draft(target, [1, 2, 3])
    torch.nn.init.zeros_(draft.confidence_head.proj.weight)
    torch.nn.init.constant_(draft.confidence_head.proj.bias, -30.0)
    stats, outs, _ = _batch(target, draft, PROMPTS, 3, N, table([(1, 1.0), (64, 640.0)]), adaptive=True)
    for (ids, m), got in zip(PROMPTS, outs):
        assert got == greedy_generate(target, ids, m)
    # the first step of each request is sized from confidences of 1.0 (nothing drafted yet, as in
    # vLLM), so it may verify; after that nothing is worth a token
    assert stats.accepted_per_verified <= 1.0 and stats.verified <= N * len(PROMPTS)
    assert stats.admitted_hist[0] > 0


def test_a_cost_table_in_the_config_is_used_as_given_and_none_is_measured():
    from hpc.config.schema import DSparkConfig
    from hpc.evaluate.adaptive_job import cost_table

    cfg = DSparkConfig()
    assert cost_table(cfg, lambda: "measured") == "measured"
    cfg.eval.adaptive_cost.verify_ms = [[1, 10.0], [64, 30.0]]
    cfg.eval.adaptive_cost.draft_ms = [[1, 2.0]]
    got = cost_table(cfg, lambda: "measured")
    assert got.verify_ms == ((1, 10.0), (64, 30.0)) and got.source.startswith("config")


def test_the_card_table_reads_the_metric_keys_back():
    from hpc.evaluate.adaptive import BatchStats
    from hpc.evaluate.adaptive_card import adaptive_markdown, table_rows

    rows = [BatchStats("n3", 8, 10, 30, 12, 92, 100.0), BatchStats("adaptive", 8, 10, 20, 12, 92, 90.0)]
    metrics = {k: v for r in rows for k, v in r.metrics().items()}
    assert table_rows(metrics)[8, "adaptive"]["accepted_per_verified"] == pytest.approx(0.6)
    md = adaptive_markdown([("pipe", "DSpark", metrics)])
    assert "| pipe | DSpark | 8 | adaptive | 0.600 | 9.20 | 1022.2 |" in md
    assert "R=8: adaptive 1.111x the best fixed (n3)" in md
    assert adaptive_markdown([]) == ""


def test_the_measured_cost_table_covers_every_step_size_up_to_the_largest():
    from hpc.evaluate.adaptive import measure_cost

    target = random_target()
    draft = random_draft(target, [1, 2, 3])
    cost = measure_cost(target, draft, [5, 17, 33], max_tokens=24, max_requests=3, context=32)
    assert [size for size, _ in cost.verify_ms] == [1, 2, 4, 8, 16, 24]
    assert all(ms > 0 for _, ms in cost.verify_ms)
    (one, t1), (three, t3) = cost.draft_ms
    assert (one, three) == (1, 3) and t3 == pytest.approx(3 * t1) and t1 > 0
    assert cost.source.startswith("measured on the reference engine (cpu, 32-token context)")


def test_the_reference_verdict_names_the_best_fixed_n_and_why():
    from hpc.evaluate.adaptive import BatchStats
    from hpc.evaluate.adaptive_job import verdict

    rows = [BatchStats("n3", 8, 10, 30, 12, 92, 100.0), BatchStats("n7", 8, 10, 70, 14, 94, 120.0),
            BatchStats("adaptive", 8, 10, 20, 12, 92, 90.0, admitted_hist=[70, 10, 0, 0, 0, 0, 0, 0])]
    line = verdict(rows, table([(1, 1.0), (64, 2.0)]), 8, 7)
    assert line.startswith("at R=8 adaptive beats the best fixed n (n3): 1.111x its tokens/s. It verified 4% of "
                           "the slots n=7 would, 0.600 of them accepted against 0.400 for n3"), line
    assert verdict(rows, table([(1, 1.0)]), 32, 7) == ""  # nothing ran at R=32
