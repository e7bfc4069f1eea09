"""Adaptive verification as a GPU vLLM serves it: the eval-adaptive job when the engine is vLLM.

One server per mode: each fixed n of eval.num_speculative_tokens, and adaptive (up to the largest
n, `enable_adaptive_verification` in the speculative config). At each eval.adaptive_concurrency R
every prompt is sent with R in flight (one joins as one finishes, as run_batch batches the
reference engine), and the server's own counters are read before and after. The figures are
what vLLM exports (`v1/spec_decode/metrics.py`, `v1/metrics/loggers.py`, read in 0.32 and 0.33):
- tok/s: completion tokens over the wall time of the whole stream, measured, not modelled;
- tokens per step: `vllm:generation_tokens` over the count of `vllm:iteration_tokens_total`,
  a histogram observed once per engine step;
- acceptance length: 1 + accepted / `num_drafts` (one per request-step that verified drafts);
- accepted per drafted: accepted / `num_draft_tokens`. vLLM counts the drafts it *scheduled*,
  n per request-step, and adaptive verification trims them on the device afterwards, so under
  adaptive this is per scheduled draft, not per verified one. vLLM exports no admitted count.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import requests

from hpc.errors import UserError
from hpc.evaluate.engines import Counters, complete

# vLLM's start-up refusal (adaptive_verification.py): an attention backend that cannot verify
# variable-length drafts, or cannot replay them in CUDA graphs.
REFUSAL = "Adaptive verification"


@dataclass
class ServedStats:
    """One mode at one concurrency on a vLLM server: the stream's wall time and the server's counters."""

    mode: str  # "n3", "n7", "adaptive"
    concurrency: int
    requests: int
    completion_tokens: int  # summed from the responses' usage
    wall_s: float
    verify_steps: int  # vLLM's num_drafts
    drafted: int  # vLLM's num_draft_tokens: scheduled, before adaptive trimming
    accepted: int
    generated: int  # vLLM's generation_tokens
    engine_steps: int

    @classmethod
    def of(cls, mode: str, R: int, requests_: int, completion_tokens: int, wall_s: float, d: Counters) -> ServedStats:
        return cls(mode, R, requests_, completion_tokens, wall_s, d.verify_steps, d.drafted_tokens, d.accepted_tokens,
                   d.generated_tokens, d.engine_steps)

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def accept_len(self) -> float:
        return 1.0 + self.accepted / self.verify_steps if self.verify_steps else 1.0

    @property
    def accepted_per_drafted(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def generated_per_step(self) -> float:
        return self.generated / self.engine_steps if self.engine_steps else 0.0

    def metrics(self) -> dict[str, float]:
        p = f"{self.mode}_R{self.concurrency}_"
        return {p + "tok_s": self.tokens_per_s, p + "accept_len": self.accept_len,
                p + "accepted_per_drafted": self.accepted_per_drafted, p + "generated_per_step": self.generated_per_step}

    def row(self) -> dict:
        return {**asdict(self), "tok_s": self.tokens_per_s, "accept_len": self.accept_len,
                "accepted_per_drafted": self.accepted_per_drafted, "generated_per_step": self.generated_per_step}


def stream(server, prompts: list[tuple[list[int], int]], concurrency: int, temperature: float = 0.0, seed: int = 0,
           timeout_s: float = 600.0) -> tuple[int, float]:
    """Every prompt, `concurrency` in flight, in order: (completion tokens, wall seconds).
    Request i samples with seed + i, whatever R: a rerun at any R asks the same questions."""
    local, sessions = threading.local(), []

    def one(item: tuple[int, tuple[list[int], int]]) -> int:
        i, (ids, max_tokens) = item
        if not hasattr(local, "session"):  # a Session per thread: requests' Session is not thread-safe
            local.session = requests.Session()
            local.session.headers.update(getattr(server, "headers", {}))
            sessions.append(local.session)  # list.append holds under the GIL
        return complete(local.session, server, ids, max_tokens, temperature, seed + i, timeout_s)

    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="dspark-eval") as pool:
            total = sum(pool.map(one, enumerate(prompts)))
    finally:
        for s in sessions:
            s.close()
    return total, time.perf_counter() - t0


def run_served(jobs, start, prompts: list[tuple[list[int], int]], Rs: list[int], temperature: float, seed: int,
               say=print) -> list[ServedStats]:
    """Each job (a runner.Job on vLLM) on its own server, `start(job)` -> VLLMEngine, at every R."""
    rows: list[ServedStats] = []
    for job in jobs:
        mode = "adaptive" if job.adaptive else f"n{job.n}"
        try:
            engine = start(job)
        except UserError as err:
            if job.adaptive and REFUSAL in str(err):
                line = next((ln.strip() for ln in str(err).splitlines() if REFUSAL in ln), "")[:300]
                raise UserError(f"eval.adaptive = true: vLLM refused adaptive verification at start-up ({line}); "
                                "set eval.adaptive=false, or serve the target on an attention backend that "
                                "verifies variable-length drafts in CUDA graphs") from err
            raise
        try:
            for R in Rs:
                before = engine.counters()
                tokens, wall = stream(engine.server, prompts, R, temperature, seed)
                rows.append(ServedStats.of(mode, R, len(prompts), tokens, wall, engine.counters().minus(before)))
                say(f"adaptive eval (vLLM): {mode} at R={R}: {rows[-1].tokens_per_s:.1f} tok/s, "
                    f"acceptance length {rows[-1].accept_len:.2f}")
        finally:
            engine.close()
    return rows


def format_served(rows: list[ServedStats]) -> str:
    head = f"{'mode':<10}{'R':>4}{'accept len':>12}{'acc/drafted':>13}{'tokens/step':>13}{'tok/s':>10}"
    lines = ["adaptive verification against fixed n on vLLM (tok/s measured; acc/drafted counts the drafts vLLM "
             "scheduled, before adaptive trims them):", head]
    for r in sorted(rows, key=lambda r: (r.concurrency, r.mode)):
        lines.append(f"{r.mode:<10}{r.concurrency:>4}{r.accept_len:>12.2f}{r.accepted_per_drafted:>13.3f}"
                     f"{r.generated_per_step:>13.2f}{r.tokens_per_s:>10.1f}")
    return "\n".join(lines)


def against_best(rows: list, R: int):
    """(adaptive's row, the fastest fixed n's row, their tok/s ratio) at R, or None; rows of
    either engine (BatchStats or ServedStats: both have mode, concurrency and tokens_per_s)."""
    ada = next((r for r in rows if r.concurrency == R and r.mode == "adaptive"), None)
    fixed = [r for r in rows if r.concurrency == R and r.mode != "adaptive"]
    if ada is None or not fixed:
        return None
    best = max(fixed, key=lambda r: r.tokens_per_s)
    return ada, best, ada.tokens_per_s / best.tokens_per_s if best.tokens_per_s else float("nan")


def served_verdict(rows: list[ServedStats], R: int) -> str:
    if (found := against_best(rows, R)) is None:
        return ""
    ada, best, ratio = found
    word = "beats" if ratio > 1 else "does not beat"
    return (f"at R={R} adaptive {word} the best fixed n ({best.mode}) on vLLM: {ratio:.3f}x its measured tok/s, "
            f"{ada.generated_per_step:.2f} tokens per engine step against {best.generated_per_step:.2f}, acceptance "
            f"length {ada.accept_len:.2f} against {best.accept_len:.2f}")
