"""Run benchmarks on an engine, one request at a time, and keep every finished benchmark.

Each benchmark's result is written atomically to `{out}/{benchmark}.json` as soon as it is
done; a requeued job finds it (same manifest sha256) and does not run it again.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


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
    drafts: int = 0
    accepted: int = 0
    accept_len: float | None = None
    per_position: list[float] = field(default_factory=list)
    baseline_tok_s: float | None = None
    speedup: float | None = None
    # (confidences, matches) per verify step: the reference engine's input to the calibration report.
    calibration_steps: list = field(default_factory=list)

    @classmethod
    def from_json(cls, d: dict) -> "BenchResult":
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def chat_ids(tokenizer, user_text: str) -> list[int]:
    """A user-only chat turn, rendered by the target's template with the generation prompt."""
    return list(tokenizer.apply_chat_template([{"role": "user", "content": user_text}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False))


def write_json_atomic(path: Path, data: dict) -> None:
    from hpc.fsio import write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps(data, indent=1) + "\n")


def finished(out_dir: Path, bench) -> BenchResult | None:
    path = out_dir / f"{bench.name}.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None  # a torn file cannot exist (atomic writes), but a hand-edited one can: rerun
    return BenchResult.from_json(data) if data.get("sha256") == bench.sha256 else None


def run_benchmarks(engine, benches: list, tokenizer, out_dir: str | Path, label: str, method: str, n: int,
                   quiet: bool = False) -> list[BenchResult]:
    out_dir = Path(out_dir)
    results = []
    todo = []
    for b in benches:
        done = finished(out_dir, b)
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
            task = bar.add_task(f"{label} n={n} {b.name}", total=len(b.prompts), rate="")
            steps_before = len(getattr(engine, "steps", []))
            before = engine.counters()
            rates, tokens, wall = [], 0, 0.0
            for text in b.prompts:
                k, seconds = engine.generate(chat_ids(tokenizer, text), b.max_tokens)
                rates.append(k / seconds if seconds > 0 else 0.0)
                tokens, wall = tokens + k, wall + seconds
                bar.update(task, advance=1, rate=f"{statistics.mean(rates):.1f} tok/s")
            delta = engine.counters().minus(before)
            res = BenchResult(b.name, len(b.prompts), b.sha256, b.source, engine.name, label, method, n,
                              statistics.mean(rates) if rates else 0.0, tokens, wall, b.max_tokens,
                              drafts=delta.drafts, accepted=delta.accepted, accept_len=delta.accept_len if n else None,
                              per_position=delta.per_position(n) if n else [],
                              calibration_steps=list(getattr(engine, "steps", [])[steps_before:]))
            write_json_atomic(out_dir / f"{b.name}.json", asdict(res))
            results.append(res)
    return results


def attach_baseline(results: list[BenchResult], baseline: dict[str, float]) -> None:
    for r in results:
        base = baseline.get(r.benchmark)
        r.baseline_tok_s = base
        r.speedup = r.tok_s / base if base else None
