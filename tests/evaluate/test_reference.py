"""The reference evaluator is exact: speculative output == plain greedy output of the target."""

from __future__ import annotations

import pytest
import torch

from hpc.errors import UserError
from hpc.evaluate.reference import greedy_generate, plain_generate, speculative_generate
from hpc.model.dspark import DSparkDraft
from tests.fixtures.draft import toy_draft_args

V, H = 96, 32


def random_target(seed: int = 0, vocab: int = V):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=H, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=512, tie_word_embeddings=False)
    return Qwen3ForCausalLM(cfg).eval().double()


def random_draft(target, aux, sample_from_anchor=True, markov_rank=8, seed=1) -> DSparkDraft:
    torch.manual_seed(seed)
    vocab = target.config.vocab_size
    args = toy_draft_args(hidden_size=H, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      intermediate_size=64, block_size=8, draft_vocab_size=vocab, mask_token_id=vocab - 1,
                      sample_from_anchor=sample_from_anchor, markov_rank=markov_rank,
                      enable_confidence_head=markov_rank > 0, target_hidden_size=H, target_vocab_size=vocab,
                      aux_layer_ids=aux)
    draft = DSparkDraft(args)
    draft.embed_tokens.weight.data.copy_(target.model.embed_tokens.weight.data)
    # Make the draft partly right: its lm_head is the target's, so acceptances really happen.
    draft.lm_head.weight.data.copy_(target.lm_head.weight.data.float())
    draft.t2d.fill_(True)
    return draft.double().eval()


class OracleDraft(DSparkDraft):
    """Proposes the true greedy continuation for a scheduled number of slots, then wrong tokens.

    The evaluator's bookkeeping must then report exactly the scheduled acceptances, and the
    context it hands the draft must equal the target's aux states of the whole verified prefix.
    """

    def setup(self, full: list[int], schedule: list[int], target, prompt_len: int):
        self.full, self.schedule, self.calls, self.target, self.prompt_len = full, schedule, 0, target, prompt_len
        self.ctx_checked = 0
        return self

    def propose(self, ctx_TH, anchor_id, anchor_pos, n):
        assert ctx_TH.shape[0] == anchor_pos and self.full[anchor_pos] == anchor_id
        if self.calls % 5 == 0:  # spot-check the accumulated context against a full recompute
            hs = self.target(torch.tensor([self.full[:anchor_pos]]), output_hidden_states=True).hidden_states
            aux = torch.stack([hs[i][0] for i in self.args.aux_layer_ids], dim=1)
            torch.testing.assert_close(ctx_TH, self.project_context(aux), rtol=1e-9, atol=1e-9)
            self.ctx_checked += 1
        good = self.schedule[self.calls % len(self.schedule)]
        self.calls += 1
        truth = self.full[anchor_pos + 1: anchor_pos + 1 + n]
        out = [t if i < good else (t + 1) % V for i, t in enumerate(truth)]
        out += [0] * (n - len(out))
        return torch.tensor(out), None


@pytest.mark.parametrize("n", [3, 7])
def test_bookkeeping_is_exact_with_a_scheduled_oracle(n):
    target = random_target()
    prompt, new_tokens = [5, 17, 33, 2], 48
    want = greedy_generate(target, prompt, new_tokens + 8)
    base = random_draft(target, [1, 2, 3])
    oracle = OracleDraft(base.args).double()
    oracle.load_state_dict(base.state_dict())
    schedule = [0, n, 1, n - 1, 2]
    oracle.setup(prompt + want, schedule, target, len(prompt))
    got, stats = speculative_generate(target, oracle, prompt, new_tokens, n)
    assert got == want[:new_tokens] and oracle.ctx_checked >= 2
    used = [schedule[i % len(schedule)] for i in range(stats.verify_steps)]
    assert stats.accepted_tokens == sum(used)
    assert stats.accepted_per_pos == [sum(u > i for u in used) for i in range(n)]
    assert stats.mean_acceptance_length == pytest.approx(1 + sum(used) / len(used))


@pytest.mark.parametrize("n,sample_from_anchor,aux", [(3, True, [1, 2, 3]), (7, True, [1, 4]), (6, False, [1, 2, 3])])
def test_speculative_output_equals_greedy_with_a_real_draft(n, sample_from_anchor, aux):
    target = random_target()
    draft = random_draft(target, aux, sample_from_anchor, markov_rank=8 if sample_from_anchor else 0)
    prompt = [60, 61, 62, 63, 64, 65, 1]
    want = greedy_generate(target, prompt, 24)
    got, stats = speculative_generate(target, draft, prompt, 24, n)
    assert got == want
    assert stats.output_tokens == 24 and stats.drafted_tokens == n * stats.verify_steps
    assert stats.target_forwards == stats.verify_steps + 1 and stats.draft_steps == stats.verify_steps


def test_adaptive_n_stays_exact_and_drafts_less():
    target = random_target()
    draft = random_draft(target, [1, 2, 3])
    torch.nn.init.constant_(draft.confidence_head.proj.bias, -1.0)  # sigmoid(-1) = 0.27: cut after one slot
    torch.nn.init.zeros_(draft.confidence_head.proj.weight)
    prompt = [5, 17, 33, 2]
    want = greedy_generate(target, prompt, 16)
    got, stats = speculative_generate(target, draft, prompt, 16, 7, conf_threshold=0.2)
    assert got == want and stats.drafted_tokens == stats.verify_steps  # 0.27 >= 0.2 > 0.27**2: one token per step


def test_eos_stops_generation():
    target = random_target()
    draft = random_draft(target, [1, 2, 3])
    want = greedy_generate(target, [5, 17, 33, 2], 20)
    eos = want[10]
    got, _ = speculative_generate(target, draft, [5, 17, 33, 2], 20, 3, eos_token_id=eos)
    assert got == want[: want.index(eos) + 1]


def test_n_larger_than_block_is_refused():
    target = random_target()
    draft = random_draft(target, [1, 2, 3])
    with pytest.raises(UserError, match="block_size is 8"):
        speculative_generate(target, draft, [1, 2], 5, 9)


# -- sampling ---------------------------------------------------------------------------------
SMALL_V, TEMP, PROMPT = 10, 1.0, [3, 1, 4, 1, 5]


def peaked_target():
    """A random target is near uniform over a tiny vocab, where every rule looks lossless; a
    scaled head gives distributions a wrong rule visibly distorts."""
    target = random_target(vocab=SMALL_V)
    target.lm_head.weight.data *= 15
    return target


def exact_marginals(target) -> list[torch.Tensor]:
    """P(token 0), P(token 1), P(token 2) of plain sampling, summed over every path (10 + 100 forwards)."""
    def probs(prefixes: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            logits = target(input_ids=torch.tensor([PROMPT + p for p in prefixes])).logits[:, -1]
        return torch.softmax(logits.float() / TEMP, -1)

    q0 = probs([[]])[0]
    q1_aV = probs([[a] for a in range(SMALL_V)])
    q2_abV = probs([[a, b] for a in range(SMALL_V) for b in range(SMALL_V)]).view(SMALL_V, SMALL_V, SMALL_V)
    p1 = q0 @ q1_aV
    p2 = torch.einsum("a,ab,abv->v", q0, q1_aV, q2_abV)
    return [q0, p1, p2]


def chi_square_p(counts: list[int], probs: torch.Tensor) -> float:
    from scipy.stats import chisquare

    total = sum(counts)
    probs = probs.double() / probs.double().sum()
    expected = [float(p) * total for p in probs]
    # Cells expected below 5 are pooled, as the test's approximation needs.
    small = [i for i, e in enumerate(expected) if e < 5]
    obs = [c for i, c in enumerate(counts) if i not in small] + [sum(counts[i] for i in small)]
    exp = [e for i, e in enumerate(expected) if i not in small] + [sum(expected[i] for i in small)]
    if not small:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp).pvalue)


def sampled_counts(target, draft, runs: int) -> tuple[list[list[int]], int, int]:
    gen = torch.Generator().manual_seed(1234)
    counts = [[0] * SMALL_V for _ in range(3)]
    accepted = drafted = 0
    for _ in range(runs):
        out, stats = speculative_generate(target, draft, PROMPT, 3, 3, temperature=TEMP, generator=gen)
        for i, tok in enumerate(out):
            counts[i][tok] += 1
        accepted, drafted = accepted + stats.accepted_tokens, drafted + stats.drafted_tokens
    return counts, accepted, drafted


@pytest.mark.slow
def test_sampled_speculative_output_is_distributed_as_the_target():
    target = peaked_target()
    draft = random_draft(target, [1, 2, 3])  # the target's head on its own hidden states: right ~25%
    counts, accepted, drafted = sampled_counts(target, draft, 1500)
    assert 0 < accepted < drafted  # both branches ran: accepted drafts and residual samples
    for i, probs in enumerate(exact_marginals(target)):
        assert chi_square_p(counts[i], probs) > 1e-3, (i, counts[i], probs.tolist())


@pytest.mark.slow
def test_the_chi_square_check_catches_a_lossy_rule(monkeypatch):
    # Accepting every draft serves the draft's distribution, not the target's: the same check must fail.
    import hpc.evaluate.reference as ref

    monkeypatch.setattr(ref, "verify_sampled", lambda d, p, q, g: (d.numel(), ref.sample(q[d.numel()], g)))
    target = peaked_target()
    counts, _, _ = sampled_counts(target, random_draft(target, [1, 2, 3]), 1500)
    p_values = [chi_square_p(c, probs) for c, probs in zip(counts, exact_marginals(target))]
    assert p_values[0] > 1e-3 and min(p_values[1:]) < 1e-6  # token 0 comes from the prefill: always exact


def test_plain_sampling_is_seeded_and_temperature_zero_is_greedy():
    target = random_target()
    a = plain_generate(target, PROMPT, 12, temperature=0.8, generator=torch.Generator().manual_seed(5))
    b = plain_generate(target, PROMPT, 12, temperature=0.8, generator=torch.Generator().manual_seed(5))
    assert a == b and plain_generate(target, PROMPT, 12, temperature=0.0) == greedy_generate(target, PROMPT, 12)


def test_calibration_record_holds_every_drafted_slot_and_the_accepted_prefix():
    """The report replays policies on the record: it must count what was drafted, not only the
    slots up to the first rejection (which made n=7 look as cheap as n=1 to a poor draft)."""
    from hpc.evaluate.confidence_report import benchmark_report, reached

    target = random_target()
    draft = random_draft(target, [1, 2, 3])
    record: list = []
    out, stats = speculative_generate(target, draft, [5, 17, 33, 2], 24, 5, record=record)
    assert record and all(len(c) == len(m) for c, m in record)
    assert all(m == sorted(m, reverse=True) for _, m in record)  # the accepted prefix, then misses
    lens = [len(c) for c, _ in record]
    assert lens[0] == 5 and lens == sorted(lens, reverse=True)  # only the output's end cuts a block
    assert sum(lens) <= stats.drafted_tokens == 5 * len(record)
    full = benchmark_report(record, cost=0.1)["full"]
    assert full["n"] == 5 and full["mean_drafted"] > 4.0 and any(0 in m for _, m in record)
    # Scored only where reached: a slot after a miss is drafted, never judged.
    assert len(reached(record, 2)) == sum(1 for _, m in record if len(m) >= 2 and m[0])


class ConfidentOracle(OracleDraft):
    def propose(self, ctx_TH, anchor_id, anchor_pos, n):
        drafts, _ = super().propose(ctx_TH, anchor_id, anchor_pos, n)
        return drafts, torch.full((n,), 0.5, dtype=torch.float64)


def test_calibration_record_ends_where_the_output_does():
    """A slot past max_new_tokens or past a drafted EOS holds no output token, so no held-out row
    can hold it either: the record leaves it out."""
    target, prompt = random_target(), [5, 17, 33, 2]
    want = greedy_generate(target, prompt, 40)
    base = random_draft(target, [1, 2, 3])

    def oracle():
        o = ConfidentOracle(base.args).double()
        o.load_state_dict(base.state_dict())
        return o.setup(prompt + want, [7], target, len(prompt))  # every draft is the truth

    record: list = []
    out, _ = speculative_generate(target, oracle(), prompt, 10, 7, record=record)
    # token 0 from the prefill, 7 drafts and a bonus: 9 tokens; the next block's first slot is the 10th
    assert out == want[:10] and [m for _, m in record] == [[1] * 7, [1]]
    e = next(i for i in range(3, 40) if i % 8 and want[i] not in want[:i])  # a drafted slot, unseen before
    record = []
    out, _ = speculative_generate(target, oracle(), prompt, 40, 7, eos_token_id=want[e], record=record)
    assert out == want[:e + 1]
    assert all(all(m) for _, m in record)
    assert sum(len(m) for _, m in record) == sum(1 for i in range(1, e + 1) if i % 8)  # drafted up to the EOS
