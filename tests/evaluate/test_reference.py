"""The reference evaluator is exact: speculative output == plain greedy output of the target."""

from __future__ import annotations

import pytest
import torch

from hpc.errors import UserError
from hpc.evaluate.reference import greedy_generate, speculative_generate
from hpc.model.dspark import DSparkArgs, DSparkDraft

V, H = 96, 32


def random_target(seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=512, tie_word_embeddings=False)
    return Qwen3ForCausalLM(cfg).eval().double()


def random_draft(target, aux, sample_from_anchor=True, markov_rank=8, seed=1) -> DSparkDraft:
    torch.manual_seed(seed)
    args = DSparkArgs(hidden_size=H, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      intermediate_size=64, block_size=8, draft_vocab_size=V, mask_token_id=V - 1,
                      sample_from_anchor=sample_from_anchor, markov_rank=markov_rank,
                      enable_confidence_head=markov_rank > 0, target_hidden_size=H, target_vocab_size=V,
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
    used = [schedule[i % len(schedule)] for i in range(stats.drafts)]
    assert stats.accepted == sum(used)
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
    assert stats.output_tokens == 24 and stats.draft_tokens == n * stats.drafts
    assert stats.verify_steps == stats.drafts + 1 and stats.draft_steps == stats.drafts


def test_adaptive_n_stays_exact_and_drafts_less():
    target = random_target()
    draft = random_draft(target, [1, 2, 3])
    torch.nn.init.constant_(draft.confidence_head.proj.bias, -1.0)  # sigmoid(-1) = 0.27: cut after one slot
    torch.nn.init.zeros_(draft.confidence_head.proj.weight)
    prompt = [5, 17, 33, 2]
    want = greedy_generate(target, prompt, 16)
    got, stats = speculative_generate(target, draft, prompt, 16, 7, conf_threshold=0.2)
    assert got == want and stats.draft_tokens == stats.drafts  # 0.27 >= 0.2 > 0.27**2: one token per step


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
