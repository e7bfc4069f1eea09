"""Exact speculative decoding in torch: an HF target verifies our draft, greedy or sampled.

This is the engine for DSpark numbers where vLLM cannot decode DSpark (its CPU build), and
the yardstick vLLM's numbers are checked against. One step:
1. the context holds the target's aux hidden states for every verified position < p;
2. the draft proposes n tokens from the anchor x_p (Markov chain, left to right);
3. the target scores [x_p, d_1..d_n] in one forward on its KV cache;
4. greedy (temperature 0): the longest prefix of drafts equal to the target's argmax is
   accepted, plus the target's own next token (the bonus). Sampled (temperature T > 0): draft i
   is accepted with probability min(1, q_i(d_i) / p_i(d_i)) (q, p: target and draft
   distributions at T); the first rejection is replaced by a sample of norm(max(0, q_i - p_i)),
   and a fully accepted block earns a bonus sampled from q. Either way a step emits 1..n+1 tokens;
5. the aux states of x_p and the accepted drafts join the context; the cache is cropped.
The output is therefore distributed exactly as plain decoding of the target at the same
temperature (token for token equal at temperature 0).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

from hpc.errors import UserError
from hpc.model.dspark import DSparkDraft
from hpc.model.teacher import loaded_target_head


@dataclass
class SpecStats:
    n: int
    verify_steps: int = 0  # target forwards that verified a draft (vLLM's num_drafts)
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    target_forwards: int = 0  # the verify steps and the prompt's prefill
    draft_steps: int = 0
    output_tokens: int = 0

    def __post_init__(self):
        self.accepted_per_pos = self.accepted_per_pos or [0] * self.n

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted_tokens / self.verify_steps if self.verify_steps else 1.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / self.verify_steps if self.verify_steps else 0.0 for a in self.accepted_per_pos]

    def merge(self, other: SpecStats) -> SpecStats:
        for k in ("verify_steps", "drafted_tokens", "accepted_tokens", "target_forwards", "draft_steps",
                  "output_tokens"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.accepted_per_pos = [a + b for a, b in zip(self.accepted_per_pos, other.accepted_per_pos)]
        return self


class TargetRunner:
    """The HF target with a KV cache, returning next-token logits and aux states per position.
    The logits are the teacher's (hpc.model.teacher) on the decoder's post-norm output: the
    distribution the draft was trained toward, which the parity tests hold equal to HF's."""

    def __init__(self, model, aux_layer_ids: list[int]):
        self.model = model
        self.decoder = model.get_decoder()
        self.head = loaded_target_head(model)
        self.aux_layer_ids = list(aux_layer_ids)
        self.n_layers = model.config.num_hidden_layers
        self._final_input: torch.Tensor | None = None

        # transformers 5 renamed past_key_values to cache; accept either build.
        params = inspect.signature(self.decoder.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._hook = None
        if self.n_layers in self.aux_layer_ids:
            # Aux id == n_layers is the last layer's output BEFORE the final norm; HF's
            # hidden_states[-1] is after it, so read the norm's input instead.
            self._hook = self.decoder.norm.register_forward_pre_hook(self._grab_final_input)
        self.reset()

    def close(self) -> None:
        """Unhook from the shared target: a hook left on it would keep this runner, and its
        KV cache, alive for as long as the target lives (one per request, before this)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.reset()  # the request's cache goes now, not with the runner

    def _grab_final_input(self, _module, args):
        self._final_input = args[0]

    def _final_input_now(self) -> torch.Tensor:
        assert self._final_input is not None  # the norm's pre-hook ran in this forward
        return self._final_input

    def reset(self) -> None:
        from transformers import DynamicCache  # transformers: loaded only on this path

        self.cache = DynamicCache()

    @torch.no_grad()
    def forward_logits(self, ids_S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(next-token logits per position [S, V], aux states [S, n_aux, H]) for new tokens."""
        out = self.decoder(input_ids=ids_S[None], use_cache=True, output_hidden_states=True,
                           **{self._cache_kwarg: self.cache})
        hs = out.hidden_states
        aux = [self._final_input_now()[0] if i == self.n_layers else hs[i][0] for i in self.aux_layer_ids]
        logits_SV = self.head(out.last_hidden_state[0])
        return logits_SV, (torch.stack(aux, dim=1) if aux else hs[0][0, :, None, :0])

    def crop(self, length: int) -> None:
        extra = self.cache.get_seq_length() - length
        if extra > 0:
            self.cache.crop(-extra)  # transformers 5 takes the number of tokens to drop


def sample(probs_V: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs_V, 1, generator=generator))


def verify_sampled(drafts_k: torch.Tensor, p_kV: torch.Tensor, q_KV: torch.Tensor,
                   generator: torch.Generator | None) -> tuple[int, int]:
    """Speculative sampling for one block: (drafts accepted, the token that follows them).

    q_KV holds the target's distributions at the k draft positions and one more (the bonus).
    Draft i survives with probability min(1, q_i(d_i) / p_i(d_i)); the first that does not is
    replaced by a sample of the residual norm(max(0, q_i - p_i)). That residual is exactly the
    mass the accepted drafts under-cover, which is what makes the step lossless.
    """
    for i, d in enumerate(drafts_k.tolist()):
        u = float(torch.rand((), generator=generator))
        if u * float(p_kV[i, d]) < float(q_KV[i, d]):
            continue
        residual_V = (q_KV[i] - p_kV[i]).clamp_min(0)
        total = float(residual_V.sum())
        # total == 0 only when p == q to rounding: then q itself is the exact residual.
        return i, sample(residual_V / total if total > 0 else q_KV[i], generator)
    return drafts_k.numel(), sample(q_KV[drafts_k.numel()], generator)


def _pick(logits_V: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    if temperature > 0:
        return sample(torch.softmax(logits_V.float() / temperature, -1), generator)
    return int(logits_V.argmax())


@dataclass
class Proposal:
    drafts: torch.Tensor  # [n] target ids
    confs: torch.Tensor | None  # [n] the confidences decoding reads, None without a head
    p_kV: torch.Tensor | None  # [n, V] the draft's distributions when sampling


class Decoding:
    """One request's speculative decoding, a verify step at a time: the stepper both the
    single-request loop and the batched one (hpc.evaluate.adaptive) drive. `verify` may be
    given a prefix of the proposal: whatever an admission rule kept."""

    def __init__(self, target, draft: DSparkDraft, prompt_ids: list[int], max_new_tokens: int, n: int,
                 eos_token_id: int | None = None, temperature: float = 0.0,
                 generator: torch.Generator | None = None,
                 record: list[tuple[list[float], list[int]]] | None = None):
        a = draft.args
        width = n if a.sample_from_anchor else n + 1
        if n < 1 or width > a.block_size:
            raise UserError(f"n={n} needs {width} draft slots but the draft's block_size is {a.block_size}; "
                            f"use n <= {a.max_n}")
        self.draft, self.n, self.max_new, self.eos = draft, n, max_new_tokens, eos_token_id
        self.temperature, self.generator, self.record = temperature, generator, record
        self.runner = TargetRunner(target, a.aux_layer_ids)
        self.stats = SpecStats(n=n)
        self.device = next(draft.parameters()).device
        logits_SV, aux_SnH = self.runner.forward_logits(torch.tensor(prompt_ids, device=self.device))
        self.stats.target_forwards += 1
        self.ctx_TH = draft.project_context(aux_SnH.to(draft.fc.weight.dtype))
        self.out = [_pick(logits_SV[-1], temperature, generator)]
        self.seq_len = len(prompt_ids)  # positions < seq_len are in the cache and the context

    @property
    def done(self) -> bool:
        return len(self.out) >= self.max_new or (self.eos is not None and self.out[-1] == self.eos)

    @torch.no_grad()
    def propose(self) -> Proposal:
        anchor = self.out[-1]
        self.stats.draft_steps += 1
        if self.temperature > 0:
            return Proposal(*self.draft.propose_sampled(self.ctx_TH, anchor, self.seq_len, self.n, self.temperature,
                                                        self.generator))
        return Proposal(*self.draft.propose(self.ctx_TH, anchor, self.seq_len, self.n), None)

    @torch.no_grad()
    def verify(self, prop: Proposal, k: int) -> int:
        """Verify the first k drafts (0 <= k <= n) in one target forward: the drafts accepted.
        k = 0 is a plain decoding step: the target's own token only."""
        drafts, confs = prop.drafts[:k], prop.confs
        anchor, max_new = self.out[-1], self.max_new
        logits_KV, aux = self.runner.forward_logits(torch.cat([torch.tensor([anchor], device=self.device), drafts]))
        self.stats.target_forwards += 1
        if self.temperature > 0:
            assert prop.p_kV is not None
            q_KV = torch.softmax(logits_KV.float() / self.temperature, -1)
            accepted, follow = verify_sampled(drafts, prop.p_kV[:k], q_KV, self.generator)
        else:
            target_next = logits_KV.argmax(-1)
            accepted = int(torch.cumprod((drafts == target_next[:k]).int(), 0).sum())
            follow = int(target_next[accepted])
        if self.record is not None and confs is not None and k:
            # A slot past the output's end (after a drafted EOS, or beyond max_new_tokens) has no
            # token in any output: the target's guess there is off the text it was calibrated on,
            # and on the toy it rejected ~one slot per prompt that no held-out row can hold.
            drafted = drafts[:accepted].tolist()
            live = min(k, max_new - len(self.out),
                       drafted.index(self.eos) + 1 if self.eos in drafted else k)
            hits = min(accepted, live)
            self.record.append(([float(c) for c in confs[:live]], [1] * hits + [0] * (live - hits)))
        s = self.stats
        s.verify_steps += 1
        s.drafted_tokens += k
        s.accepted_tokens += accepted
        for i in range(accepted):
            s.accepted_per_pos[i] += 1
        new = drafts[:accepted].tolist() + [follow]
        # Verified positions: the anchor and the accepted drafts; the rest of the cache is stale.
        self.runner.crop(self.seq_len + accepted + 1)
        self.ctx_TH = torch.cat([self.ctx_TH, self.draft.project_context(aux[: accepted + 1].to(self.ctx_TH.dtype))])
        self.seq_len += accepted + 1
        if self.eos is not None and self.eos in new:
            new = new[: new.index(self.eos) + 1]
        self.out.extend(new)
        return accepted

    def finish(self) -> tuple[list[int], SpecStats]:
        self.runner.close()  # the cache goes with it
        out = self.out[:self.max_new]
        self.stats.output_tokens = len(out)
        return out, self.stats


@torch.no_grad()
def speculative_generate(
    target, draft: DSparkDraft, prompt_ids: list[int], max_new_tokens: int, n: int,
    eos_token_id: int | None = None, conf_threshold: float | None = None,
    record: list[tuple[list[float], list[int]]] | None = None,
    temperature: float = 0.0, generator: torch.Generator | None = None,
) -> tuple[list[int], SpecStats]:
    """Speculative decoding; returns (generated ids, stats). n <= draft block size.

    `record`, when given, collects (confidences, accepted) per verify step for the calibration
    report: every drafted slot up to the output's end, accepted = 1 on the accepted prefix. The
    confidence head predicts "slot i is accepted given every earlier slot was", so the report
    scores a slot's confidence only where every earlier one was accepted; the policies it
    replays count every drafted slot as drafted.
    Accepted means "equals the target's greedy token" at temperature 0 and "survived the
    min(1, q/p) test" when sampling: the event each decoding mode actually runs on.
    """
    dec = Decoding(target, draft, prompt_ids, max_new_tokens, n, eos_token_id, temperature, generator, record)
    while not dec.done:
        prop = dec.propose()
        k = n
        if conf_threshold is not None and prop.confs is not None:
            # Adaptive n: stop drafting where the chance the whole prefix survives drops too low.
            k = max(int((torch.cumprod(prop.confs, 0) >= conf_threshold).sum()), 1)
        dec.verify(prop, k)
    return dec.finish()


@torch.no_grad()
def plain_generate(target, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None = None,
                   temperature: float = 0.0, generator: torch.Generator | None = None) -> list[int]:
    """Decoding without a draft on the same cache path: the exactness check and the baseline."""
    runner = TargetRunner(target, [])
    ids = torch.tensor(prompt_ids, device=target.device)
    out: list[int] = []
    while len(out) < max_new_tokens:
        nxt = _pick(runner.forward_logits(ids)[0][-1], temperature, generator)
        out.append(nxt)
        if nxt == eos_token_id:
            break
        ids = torch.tensor([nxt], device=target.device)
    runner.close()
    return out


def greedy_generate(target, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None = None) -> list[int]:
    return plain_generate(target, prompt_ids, max_new_tokens, eos_token_id)


def mean_acceptance_length(target, draft: DSparkDraft, prompts: list[list[int]], n: int, max_new_tokens: int,
                           eos_token_id: int | None = None) -> tuple[float, SpecStats]:
    """Pooled over prompts, as vLLM's counters pool requests: 1 + accepted tokens / verify steps."""
    total = SpecStats(n=n)
    for ids in prompts:
        total.merge(speculative_generate(target, draft, ids, max_new_tokens, n, eos_token_id)[1])
    return total.mean_acceptance_length, total
