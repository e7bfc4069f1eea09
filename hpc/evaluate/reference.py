"""Exact greedy speculative decoding in torch: an HF target verifies our draft.

This is the engine for DSpark numbers where vLLM cannot decode DSpark (its CPU build), and
the yardstick vLLM's numbers are checked against. One step:
1. the context holds the target's aux hidden states for every verified position < p;
2. the draft proposes n tokens from the anchor x_p (Markov chain sampled left to right);
3. the target scores [x_p, d_1..d_n] in one forward on its KV cache;
4. the longest prefix of drafts equal to the target's argmax is accepted, plus the target's
   own next token (the bonus), so every step emits between 1 and n+1 tokens;
5. the aux states of x_p and the accepted drafts join the context; the cache is cropped.
The output therefore equals plain greedy decoding of the target, token for token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hpc.model.dspark import DSparkDraft


@dataclass
class SpecStats:
    n: int
    drafts: int = 0  # verify steps that carried a draft (vLLM's num_drafts)
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    verify_steps: int = 0
    draft_steps: int = 0
    output_tokens: int = 0

    def __post_init__(self):
        self.accepted_per_pos = self.accepted_per_pos or [0] * self.n

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / self.drafts if self.drafts else 0.0 for a in self.accepted_per_pos]

    def merge(self, other: "SpecStats") -> "SpecStats":
        for k in ("drafts", "draft_tokens", "accepted", "verify_steps", "draft_steps", "output_tokens"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.accepted_per_pos = [a + b for a, b in zip(self.accepted_per_pos, other.accepted_per_pos)]
        return self


class TargetRunner:
    """The HF target with a KV cache, returning next-token argmax and aux states per position."""

    def __init__(self, model, aux_layer_ids: list[int]):
        self.model = model
        self.aux_layer_ids = list(aux_layer_ids)
        self.n_layers = model.config.num_hidden_layers
        self._final_input: torch.Tensor | None = None
        import inspect

        # transformers 5 renamed past_key_values to cache; accept either build.
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        if self.n_layers in self.aux_layer_ids:
            # Aux id == n_layers is the last layer's output BEFORE the final norm; HF's
            # hidden_states[-1] is after it, so read the norm's input instead.
            model.model.norm.register_forward_pre_hook(self._grab_final_input)
        self.reset()

    def _grab_final_input(self, _module, args):
        self._final_input = args[0]

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache()

    @torch.no_grad()
    def forward(self, ids_S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(argmax next token per position [S], aux states [S, n_aux, H]) for new tokens."""
        out = self.model(input_ids=ids_S[None], use_cache=True, output_hidden_states=True,
                         **{self._cache_kwarg: self.cache})
        hs = out.hidden_states
        aux = [self._final_input[0] if i == self.n_layers else hs[i][0] for i in self.aux_layer_ids]
        return out.logits[0].argmax(-1), (torch.stack(aux, dim=1) if aux else hs[0][0, :, None, :0])

    def crop(self, length: int) -> None:
        extra = self.cache.get_seq_length() - length
        if extra > 0:
            self.cache.crop(-extra)  # transformers 5 takes the number of tokens to drop


@torch.no_grad()
def speculative_generate(
    target, draft: DSparkDraft, prompt_ids: list[int], max_new_tokens: int, n: int,
    eos_token_id: int | None = None, conf_threshold: float | None = None,
    record: list[tuple[list[float], list[int]]] | None = None,
) -> tuple[list[int], SpecStats]:
    """Greedy speculative decoding; returns (generated ids, stats). n <= draft block size.

    `record`, when given, collects (confidences, matches) per verify step for the calibration
    report: match i = draft i equals the target's greedy token at that position.
    """
    from hpc.errors import UserError

    a = draft.args
    width = n if a.sample_from_anchor else n + 1
    if n < 1 or width > a.block_size:
        raise UserError(f"n={n} needs {width} draft slots but the draft's block_size is {a.block_size}; "
                        f"use n <= {a.block_size - (0 if a.sample_from_anchor else 1)}")
    runner = TargetRunner(target, a.aux_layer_ids)
    stats = SpecStats(n=n)
    device = next(draft.parameters()).device
    prompt = torch.tensor(prompt_ids, device=device)
    next_S, aux_SnH = runner.forward(prompt)
    stats.verify_steps += 1
    ctx_TH = draft.project_context(aux_SnH.to(draft.fc.weight.dtype))
    out = [int(next_S[-1])]
    seq_len = len(prompt_ids)  # positions < seq_len are in the cache and the context
    while len(out) < max_new_tokens and (eos_token_id is None or out[-1] != eos_token_id):
        anchor = out[-1]
        drafts, confs = draft.propose(ctx_TH, anchor, seq_len, n)
        stats.draft_steps += 1
        if conf_threshold is not None and confs is not None:
            # Adaptive n: stop drafting where the chance the whole prefix survives drops too low.
            survive = torch.cumprod(confs, 0)
            keep = int((survive >= conf_threshold).sum())
            drafts = drafts[:max(keep, 1)]
        k = drafts.numel()
        verify_ids = torch.cat([torch.tensor([anchor], device=device), drafts])
        target_next, aux = runner.forward(verify_ids)
        stats.verify_steps += 1
        matches = (drafts == target_next[:k]).int()
        accepted = int(torch.cumprod(matches, 0).sum())
        if record is not None and confs is not None:
            record.append(([float(c) for c in confs[:k]], matches.tolist()))
        stats.drafts += 1
        stats.draft_tokens += k
        stats.accepted += accepted
        for i in range(accepted):
            stats.accepted_per_pos[i] += 1
        new = drafts[:accepted].tolist() + [int(target_next[accepted])]
        # Verified positions: the anchor and the accepted drafts; the rest of the cache is stale.
        runner.crop(seq_len + accepted + 1)
        ctx_TH = torch.cat([ctx_TH, draft.project_context(aux[: accepted + 1].to(ctx_TH.dtype))])
        seq_len += accepted + 1
        if eos_token_id is not None and eos_token_id in new:
            new = new[: new.index(eos_token_id) + 1]
        out.extend(new)
    out = out[:max_new_tokens]
    stats.output_tokens = len(out)
    return out, stats


@torch.no_grad()
def greedy_generate(target, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None = None) -> list[int]:
    """Plain greedy decoding on the same cache path, for the exactness check."""
    runner = TargetRunner(target, [])
    ids = torch.tensor(prompt_ids, device=target.device)
    out: list[int] = []
    while len(out) < max_new_tokens:
        nxt = int(runner.forward(ids)[0][-1])
        out.append(nxt)
        if nxt == eos_token_id:
            break
        ids = torch.tensor([nxt], device=target.device)
    return out


def mean_acceptance_length(target, draft: DSparkDraft, prompts: list[list[int]], n: int, max_new_tokens: int,
                           eos_token_id: int | None = None) -> tuple[float, SpecStats]:
    """Pooled over prompts, as vLLM's counters pool requests: 1 + accepted / drafts."""
    total = SpecStats(n=n)
    for ids in prompts:
        total.merge(speculative_generate(target, draft, ids, max_new_tokens, n, eos_token_id)[1])
    return total.mean_acceptance_length, total
