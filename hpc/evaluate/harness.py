"""Run benchmarks on an engine, one request at a time, and keep every finished benchmark.

Each benchmark's result is written atomically to `{out}/{benchmark}.json` as soon as it is
done; a requeued job finds it (same manifest sha256) and does not run it again.

Timing is paired when a baseline engine is given: baseline and draft requests alternate on the
same prompts (baseline, draft, baseline, draft, ...), and the prompts repeat until there are
`min_pairs` pairs. The speedup is the median of the per-pair ratios, with its quartiles as the
spread, so drift of the machine between two windows cannot pose as a speedup.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from hpc.fsio import write_text

# Result-file keys before the counts were named for what they count -> their names now.
LEGACY_NAMES = {"drafts": "verify_steps", "accepted": "accepted_tokens"}


@dataclass
class BenchResult:
    benchmark: str
    rows: int
    sha256: str
    source: str
    engine: str
    label: str  # "baseline", "DSpark", "eagle3", ...
    method: str  # "none" for the baseline
    n: int  # 0 for the baseline
    tok_s: float  # mean over requests of output tokens / request wall time
    output_tokens: int
    wall_s: float
    max_tokens: int
    concurrency: int = 1
    verify_steps: int = 0  # target forwards that verified a draft (vLLM's num_drafts)
    drafted_tokens: int | None = 0  # None: a file from before the count was kept
    accepted_tokens: int = 0
    accept_len: float | None = None
    per_position: list[float] = field(default_factory=list)
    baseline_tok_s: float | None = None
    speedup: float | None = None  # paired: median of per-pair ratios; cached: tok_s / baseline_tok_s
    speedup_lo: float | None = None  # quartiles of the per-pair ratios (paired timing only)
    speedup_hi: float | None = None
    pairs: int = 0
    timing: str = "cached"
    temperature: float = 0.0
    # (confidences, matches) per verify step: the reference engine's input to the calibration report.
    calibration_steps: list = field(default_factory=list)
    # How those confidences were read (eval.confidence: served | side_file); "" without a head.
    confidence: str = ""
    # [verify steps, accepted tokens] of each prompt's first decode, in the manifest's order: what
    # a bootstrap over prompts resamples (`dspark-dev bench acceptance`). Empty for the baseline.
    per_prompt: list = field(default_factory=list)

    @classmethod
    def from_json(cls, d: dict) -> BenchResult:
        # Files written before the rename said `drafts` for verify steps and kept no drafted
        # tokens; a requeue or an upload still reads them as measured.
        if "drafts" in d or "accepted" in d:
            d = {LEGACY_NAMES.get(k, k): v for k, v in d.items()}
            d.setdefault("drafted_tokens", None)
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def chat_ids(tokenizer, user_text: str) -> list[int]:
    """A user-only chat turn, rendered by the target's template with the generation prompt."""
    return list(tokenizer.apply_chat_template([{"role": "user", "content": user_text}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False))


def write_json_atomic(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps(data, indent=1) + "\n")


def timing_of(paired: bool) -> str:
    """How a result's speedup was measured: `paired` (baseline and draft alternating on the same
    prompts) or `cached` (against a baseline measured once, in another window)."""
    return "paired" if paired else "cached"


def finished(out_dir: Path, bench, engine: str | None = None, timing: str | None = None,
             confidence: str | None = None) -> BenchResult | None:
    """The result already measured for `bench` in `out_dir`, if it was measured on these prompts,
    on this `engine` and with this `timing`: a run directory is named for the draft, so an
    evaluation on another engine (vLLM after the reference loop) or timing would read the last
    one's figures as its own."""
    path = out_dir / f"{bench.name}.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None  # a torn file cannot exist (atomic writes), but a hand-edited one can: rerun
    if data.get("sha256") != bench.sha256 or (engine is not None and data.get("engine") != engine) \
            or (timing is not None and data.get("timing", "cached") != timing) \
            or (confidence is not None and data.get("confidence", "") != confidence):
        return None
    return BenchResult.from_json(data)


# A speedup above the acceptance length is impossible (a verify step costs at least a target
# forward); 5% of slack covers the draft being nearly free. Beyond it, the figure is timing noise.
NOISE_SLACK = 1.05


def implausible(speedup: float | None, accept_len: float | None) -> bool:
    return speedup is not None and accept_len is not None and speedup > accept_len * NOISE_SLACK


def ratio_spread(ratios: list[float]) -> tuple[float, float, float]:
    """(median, lower quartile, upper quartile) of the per-pair speedups."""
    if len(ratios) == 1:
        return ratios[0], ratios[0], ratios[0]
    lo, mid, hi = statistics.quantiles(ratios, n=4, method="inclusive")
    return mid, lo, hi


def _rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def run_benchmarks(engine, benches: list, tokenizer, out_dir: str | Path, label: str, method: str, n: int,
                   quiet: bool = False, baseline=None, min_pairs: int = 1,
                   temperature: float = 0.0) -> list[BenchResult]:
    out_dir = Path(out_dir)
    results = []
    todo = []
    for b in benches:
        done = finished(out_dir, b, engine.name, timing_of(baseline is not None), getattr(engine, "confidence", ""))
        if done is not None:
            if not quiet:
                print(f"{label} n={n}: {b.name} already done ({out_dir / (b.name + '.json')}), not re-run")
            results.append(done)
        else:
            todo.append(b)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
               TimeRemainingColumn())
    with Progress(*columns, disable=quiet, transient=False) as bar:
        for b in todo:
            passes = math.ceil(min_pairs / len(b.prompts)) if baseline is not None else 1
            task = bar.add_task(f"{label} n={n} {b.name}", total=passes * len(b.prompts), rate="")
            steps_before = len(getattr(engine, "steps", []))
            first_pass: list = []
            before = engine.counters()
            last, per_prompt = before, []
            rates, base_rates, ratios, tokens, wall = [], [], [], 0, 0.0
            for p in range(passes):
                for text in b.prompts:
                    ids = chat_ids(tokenizer, text)
                    if baseline is not None:
                        base_rates.append(_rate(*baseline.generate(ids, b.max_tokens)))
                    k, seconds = engine.generate(ids, b.max_tokens)
                    rates.append(_rate(k, seconds))
                    if baseline is not None and base_rates[-1] > 0:
                        ratios.append(rates[-1] / base_rates[-1])
                    tokens, wall = tokens + k, wall + seconds
                    if n and p == 0:  # single-stream: the counters' change is this prompt's alone
                        now = engine.counters()
                        per_prompt.append([now.verify_steps - last.verify_steps,
                                           now.accepted_tokens - last.accepted_tokens])
                        last = now
                    bar.update(task, advance=1, rate=f"{statistics.mean(rates):.1f} tok/s")
                if p == 0:  # the calibration report reads one decode per prompt: more passes repeat it
                    first_pass = list(getattr(engine, "steps", [])[steps_before:])
            delta = engine.counters().minus(before)
            res = BenchResult(b.name, len(b.prompts), b.sha256, b.source, engine.name, label, method, n,
                              statistics.mean(rates) if rates else 0.0, tokens, wall, b.max_tokens,
                              verify_steps=delta.verify_steps, drafted_tokens=delta.drafted_tokens,
                              accepted_tokens=delta.accepted_tokens, accept_len=delta.accept_len if n else None,
                              per_position=delta.per_position(n) if n else [], temperature=temperature,
                              calibration_steps=first_pass, confidence=getattr(engine, "confidence", ""),
                              per_prompt=per_prompt)
            if ratios:
                res.speedup, res.speedup_lo, res.speedup_hi = ratio_spread(ratios)
                res.baseline_tok_s, res.pairs, res.timing = statistics.mean(base_rates), len(ratios), timing_of(True)
            write_json_atomic(out_dir / f"{b.name}.json", asdict(res))
            results.append(res)
    return results


def attach_baseline(results: list[BenchResult], baseline: dict[str, float]) -> None:
    for r in results:
        base = baseline.get(r.benchmark)
        r.baseline_tok_s = base
        r.speedup = r.tok_s / base if base else None
