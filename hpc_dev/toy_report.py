"""`dspark-dev toy-target --report`: does the toy target talk, or loop? Figures on the eval fixtures.

A target whose greedy output repeats itself makes every draft look good (any draft that learns
"repeat" is accepted), so before an acceptance figure means anything the target must pass:
- distinct-token ratio of each greedy output (distinct ids / ids) >= 0.4;
- prompt-lookup hit rate <= 0.4: the share of generated tokens that an n-gram lookup in prompt +
  output so far (the longest suffix of 4..1 tokens seen before, as vLLM's ngram drafts) predicts;
- no output with one token repeated more than 8 times in a row;
and held-out perplexity, on exchanges the build kept out of training, says it learned language.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from hpc.config.schema import BENCHMARKS, EvalConfig
from hpc.evaluate.harness import chat_ids
from hpc.formats.benchmarks import load_benchmark

GOALS = {"distinct": 0.4, "lookup": 0.4, "run": 8}


def lookup_prediction(ctx: list[int], max_n: int = 4, min_n: int = 1) -> int | None:
    """The token after the latest earlier match of the longest suffix (prompt lookup)."""
    for n in range(min(max_n, len(ctx) - 1), min_n - 1, -1):
        suffix = ctx[-n:]
        for j in range(len(ctx) - n - 1, -1, -1):
            if ctx[j:j + n] == suffix:
                return ctx[j + n]
    return None


def lookup_hits(prompt: list[int], out: list[int]) -> int:
    return sum(lookup_prediction(prompt + out[:i]) == tok for i, tok in enumerate(out))


def longest_run(ids: list[int]) -> int:
    best = run = 0
    for i, tok in enumerate(ids):
        run = run + 1 if i and tok == ids[i - 1] else 1
        best = max(best, run)
    return best


def output_figures(prompt: list[int], out: list[int]) -> dict:
    return {"tokens": len(out), "distinct": len(set(out)) / len(out) if out else 0.0,
            "lookup_hits": lookup_hits(prompt, out), "longest_run": longest_run(out)}


def held_out_perplexity(model, tok, model_dir: Path, limit: int = 200) -> float | None:
    import torch  # torch: loaded only on this path

    path = model_dir / "held_out.jsonl"
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines()[:limit]]
    nll, count = 0.0, 0
    with torch.no_grad():
        for r in rows:
            conv = [{"role": "user", "content": r["user"]}, {"role": "assistant", "content": r["assistant"]}]
            ids = tok.apply_chat_template(conv, tokenize=True, return_dict=False)
            ids_1T = torch.tensor([ids])
            out = model(input_ids=ids_1T, labels=ids_1T)
            nll, count = nll + out.loss.item() * (len(ids) - 1), count + len(ids) - 1
    return math.exp(nll / count) if count else None


def report(model_dir: str | Path, max_new_tokens: int = 128, benchmarks: list[str] | None = None) -> dict:
    import torch  # torch: loaded only on this path
    from transformers import AutoModelForCausalLM, AutoTokenizer  # transformers: loaded only on this path

    model_dir = Path(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, use_safetensors=True).eval()
    eval_cfg = EvalConfig(fixtures=True, max_tokens=max_new_tokens, code_max_tokens=max_new_tokens)
    per_bench = {}
    for name in benchmarks or BENCHMARKS:
        outs = []
        for text in load_benchmark(name, eval_cfg).prompts:
            prompt = chat_ids(tok, text)
            with torch.no_grad():
                gen = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                     eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            out = gen[0, len(prompt):].tolist()
            outs.append({**output_figures(prompt, out), "text": tok.decode(out)})
        tokens = sum(o["tokens"] for o in outs)
        per_bench[name] = {"outputs": outs, "distinct_min": min(o["distinct"] for o in outs),
                           "distinct_median": statistics.median(o["distinct"] for o in outs),
                           "lookup_rate": sum(o["lookup_hits"] for o in outs) / max(tokens, 1),
                           "longest_run": max(o["longest_run"] for o in outs),
                           "mean_tokens": tokens / len(outs)}
    return {"model": str(model_dir), "max_new_tokens": max_new_tokens, "benchmarks": per_bench,
            "held_out_perplexity": held_out_perplexity(model, tok, model_dir)}


def meets_goals(r: dict) -> bool:
    b = r["benchmarks"].values()
    return all(x["distinct_min"] >= GOALS["distinct"] and x["lookup_rate"] <= GOALS["lookup"]
               and x["longest_run"] <= GOALS["run"] for x in b)


def format_report(r: dict) -> str:
    lines = [f"toy target {r['model']}: greedy outputs of up to {r['max_new_tokens']} tokens on the eval fixtures",
             f"{'benchmark':<18} {'outputs':>7} {'tokens':>7} {'distinct min/med':>17} {'lookup hit':>10} "
             f"{'longest run':>11}"]
    for name, b in r["benchmarks"].items():
        lines.append(f"{name:<18} {len(b['outputs']):>7} {b['mean_tokens']:>7.0f} "
                     f"{b['distinct_min']:>8.2f}/{b['distinct_median']:<8.2f} {b['lookup_rate']:>10.2f} "
                     f"{b['longest_run']:>11}")
    ppl = r["held_out_perplexity"]
    lines.append(f"held-out perplexity: {'-' if ppl is None else f'{ppl:.1f}'}")
    lines.append(f"goals (distinct >= {GOALS['distinct']}, lookup hit <= {GOALS['lookup']}, run <= {GOALS['run']}): "
                 f"{'met' if meets_goals(r) else 'NOT met'}")
    first = next(iter(r["benchmarks"].values()))["outputs"][0]["text"]
    lines.append(f"e.g. {first[:200]!r}")
    return "\n".join(lines)
