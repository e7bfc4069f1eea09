"""Adaptive verification on the reference engine: vLLM's admission rule across R requests.

vLLM (`v1/worker/gpu/spec_decode/adaptive_verification.py`, read in 0.32 and 0.33) runs each
step of a batch of R decoding requests like this:
1. every request drafts its n slots; slot k scores its survival, the running product of that
   request's confidences 1..k;
2. the draft budget K is the one that maximises expected tokens per millisecond:
   (R + the K best survivals summed) / (draft_ms[R] + verify_ms[R + K]), from cost tables of
   profiled step times; the survivals it sizes K from are the previous step's (an asynchronous
   copy), 1.0 for a request that has not drafted yet;
3. the global top-K of the current survivals are verified. Survival only falls along a
   request, so each request keeps a prefix of its drafts, perhaps none.

`run_batch` does exactly that with our `Decoding` stepper, the requests continuously batched
(one joins as one finishes). It also runs fixed n the same way (every request verifies all n
slots), so every mode is priced by the same cost table: the modelled tokens per second is
the one figure that weighs accepted tokens against what verifying them costs.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from hpc.evaluate.reference import Decoding, Proposal, TargetRunner

PROFILE_REPLAYS = 5  # vLLM's _PROFILE_REPLAYS: medians of five timed steps per size


@dataclass(frozen=True)
class CostTable:
    """Step time against step size: verify_ms over tokens verified in one step (R anchors plus
    the admitted drafts), draft_ms over requests drafted. Between points the time is
    interpolated, past the last extrapolated linearly, as vLLM prices steps it does not pad to
    a captured CUDA graph; each curve is made non-decreasing first, as vLLM's is."""

    verify_ms: tuple[tuple[int, float], ...]
    draft_ms: tuple[tuple[int, float], ...]
    source: str  # "config" or what measured it

    def verify(self, tokens: int) -> float:
        return max(_price(self.verify_ms, tokens), 1e-6)

    def draft(self, requests: int) -> float:
        return max(_price(self.draft_ms, requests), 0.0)

    def step_ms(self, requests: int, drafts: int) -> float:
        return self.draft(requests) + self.verify(requests + drafts)

    def record(self) -> dict:
        return {"verify_ms": [list(p) for p in self.verify_ms], "draft_ms": [list(p) for p in self.draft_ms],
                "source": self.source}


def _price(curve: tuple[tuple[int, float], ...], size: int) -> float:
    xs = [x for x, _ in curve]
    ys: list[float] = []
    for _, y in curve:
        ys.append(max(y, ys[-1]) if ys else y)
    if size <= xs[0] or len(xs) == 1:
        return ys[0] if size <= xs[0] else ys[0] * size / xs[0]
    for i in range(1, len(xs)):
        if size <= xs[i] or i == len(xs) - 1:
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
            return y0 + (y1 - y0) * (size - x0) / (x1 - x0)
    raise AssertionError("unreachable")


def draft_budget(survival_RN: torch.Tensor, cost: CostTable) -> int:
    """vLLM's K: of the budgets 0..R*n, the first that maximises (R + the K best survivals
    summed) / (draft_ms[R] + verify_ms[R + K]). Every request decodes, so every request
    earns its one token whatever K is."""
    R = survival_RN.shape[0]
    scores = survival_RN.flatten().double().sort(descending=True).values
    expected = torch.cat([torch.zeros(1, dtype=torch.float64), scores.cumsum(0)]) + R
    costs = torch.tensor([cost.step_ms(R, k) for k in range(scores.numel() + 1)], dtype=torch.float64)
    return int((expected / costs).argmax())


def admit(survival_RN: torch.Tensor, budget: int) -> list[int]:
    """Drafts each request keeps: the global top-`budget` of survival. A stable sort breaks
    ties by slot order, so what a request keeps is always a prefix, as it is in vLLM."""
    R, N = survival_RN.shape
    order = torch.argsort(-survival_RN.flatten().double(), stable=True)[:budget]
    return torch.bincount(order // N, minlength=R).tolist()


@dataclass
class BatchStats:
    """One mode at one concurrency, pooled over every request."""

    mode: str  # "n3", "n7", "adaptive"
    concurrency: int
    steps: int = 0  # batched verify steps
    verified: int = 0  # drafts verified (the admitted ones)
    accepted: int = 0
    generated: int = 0  # tokens the verify steps emitted: accepted drafts + one per request-step
    modelled_ms: float = 0.0  # the steps priced by the cost table
    admitted_hist: list[int] = field(default_factory=list)  # request-steps that verified k drafts

    @property
    def accepted_per_verified(self) -> float:
        return self.accepted / self.verified if self.verified else 0.0

    @property
    def generated_per_step(self) -> float:
        return self.generated / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 * self.generated / self.modelled_ms if self.modelled_ms else 0.0

    def metrics(self) -> dict[str, float]:
        p = f"{self.mode}_R{self.concurrency}_"
        return {p + "accepted_per_verified": self.accepted_per_verified,
                p + "generated_per_step": self.generated_per_step, p + "modelled_tok_s": self.tokens_per_s}

    def row(self) -> dict:
        return {**asdict(self), "accepted_per_verified": self.accepted_per_verified,
                "generated_per_step": self.generated_per_step, "modelled_tok_s": self.tokens_per_s}


def run_batch(new_request, prompts: list[tuple[list[int], int]], concurrency: int, n: int, cost: CostTable,
              adaptive: bool, traces: list[list[int]] | None = None) -> BatchStats:
    """Decode every prompt, `concurrency` at a time, each step verifying either all n drafts of
    every request (fixed n) or vLLM's admitted prefix of them (adaptive). `new_request(ids,
    max_tokens)` makes a `Decoding` at n; prompts are (ids, max_tokens) in arrival order.
    `traces`, when given, collects each request's accepted drafts per step, in arrival order."""
    stats = BatchStats("adaptive" if adaptive else f"n{n}", concurrency, admitted_hist=[0] * (n + 1))
    trace_of: dict[Decoding, list[int]] = {}
    queue = list(reversed(prompts))
    live: list[Decoding] = []
    stale: dict[Decoding, torch.Tensor] = {}  # each request's last step's confidences
    while True:
        for d in [d for d in live if _finished(d)]:
            live.remove(d)
            trace_of.pop(d)  # its trace lives on in `traces`; the request (its context) goes now
        while queue and len(live) < concurrency:
            d = new_request(*queue.pop())
            trace_of[d] = []
            if traces is not None:
                traces.append(trace_of[d])
            if not _finished(d):
                live.append(d)
            else:
                trace_of.pop(d)
        if not live:
            return stats
        props: list[Proposal] = [d.propose() for d in live]
        if adaptive:
            now_RN = torch.stack([_confs(p, n) for p in props])
            before_RN = torch.stack([stale.get(d, torch.ones(n)) for d in live])
            keep = admit(now_RN.cumprod(1), draft_budget(before_RN.cumprod(1), cost))
            stale = dict(zip(live, now_RN))
        else:
            keep = [n] * len(live)
        for d, p, k in zip(live, props, keep):
            a = d.verify(p, k)
            trace_of[d].append(a)
            stats.verified += k
            stats.accepted += a
            stats.generated += a + 1
            stats.admitted_hist[k] += 1
        stats.steps += 1
        stats.modelled_ms += cost.step_ms(len(live), sum(keep))


def replay_fixed(traces: list[list[int]], concurrency: int, n: int, cost: CostTable) -> BatchStats:
    """Fixed n at another concurrency, from one decode's traces: a request that verifies all n
    slots every step decodes alike whatever runs beside it (its own generator when sampling),
    so only the batching, and what the steps cost, differ. Batched as `run_batch` batches."""
    stats = BatchStats(f"n{n}", concurrency, admitted_hist=[0] * (n + 1))
    queue = [list(t) for t in reversed(traces)]
    live: list[list[int]] = []
    while True:
        live = [t for t in live if t]
        while queue and len(live) < concurrency:
            if t := queue.pop():
                live.append(t)
        if not live:
            return stats
        for t in live:
            a = t.pop(0)
            stats.verified += n
            stats.accepted += a
            stats.generated += a + 1
            stats.admitted_hist[n] += 1
        stats.steps += 1
        stats.modelled_ms += cost.step_ms(len(live), n * len(live))


def _finished(d: Decoding) -> bool:
    if d.done:
        d.finish()
        return True
    return False


def _confs(p: Proposal, n: int) -> torch.Tensor:
    if p.confs is None:
        raise ValueError("adaptive verification ranks drafts by the confidence head, and this draft has none")
    return p.confs.float().cpu()[:n]


def measure_cost(target, draft, anchor_ids: list[int], max_tokens: int, max_requests: int,
                 context: int = 256) -> CostTable:
    """The reference engine's own cost table, as vLLM profiles its own: the median of
    PROFILE_REPLAYS timed target forwards over T new tokens after a `context`-token prefix
    (vLLM flattens a batch's tokens into one forward), for T doubling up to `max_tokens`; and
    the draft's proposal for one request, times R (this engine drafts requests one by one)."""
    device = next(draft.parameters()).device
    ctx_ids = torch.tensor((anchor_ids * (context // max(len(anchor_ids), 1) + 1))[:context], device=device)
    runner = TargetRunner(target, draft.args.aux_layer_ids)
    sizes = sorted({1, max_tokens} | {2 ** i for i in range(max_tokens.bit_length()) if 2 ** i < max_tokens})
    try:
        _, aux = runner.forward_logits(ctx_ids)
        ctx_TH = draft.project_context(aux.to(draft.fc.weight.dtype))
        inputs = {size: ctx_ids[:size] if size <= context else ctx_ids.repeat(size // context + 1)[:size]
                  for size in sizes}
        samples: dict[int, list[float]] = {size: [] for size in sizes}
        # Round robin over the sizes, the first round a warm-up: a load that drifts while this
        # runs (another job on the node) then weighs on every size alike, not on a few.
        for replay in range(PROFILE_REPLAYS + 1):
            for size in sizes:
                t0 = time.perf_counter()
                runner.forward_logits(inputs[size])
                if replay:
                    samples[size].append((time.perf_counter() - t0) * 1000)
                runner.crop(context)
        verify = [(size, statistics.median(samples[size])) for size in sizes]
        times = []
        for _ in range(PROFILE_REPLAYS + 1):
            t0 = time.perf_counter()
            draft.propose(ctx_TH, int(ctx_ids[-1]), context, draft.args.max_n)
            times.append((time.perf_counter() - t0) * 1000)
    finally:
        runner.close()
    one = statistics.median(times[1:])
    return CostTable(tuple(verify), ((1, one), (max_requests, one * max_requests)),
                     f"measured on the reference engine ({device}, {context}-token context)")
