"""Paired timing: baseline and draft requests alternate on the same prompts, on real engines."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from hpc.evaluate.engines import Counters, ReferenceEngine
from hpc.evaluate.harness import BenchResult, finished, implausible, ratio_spread, run_benchmarks
from tests.evaluate.test_reference import random_draft, random_target


class CharTokenizer:
    """Enough of a tokenizer for chat_ids: a user turn as byte ids (the target's vocab is 96)."""

    def apply_chat_template(self, messages, **_):
        return [b % 90 for b in messages[0]["content"].encode()]


class Recorded:
    """A real engine whose calls are written down in one shared order."""

    def __init__(self, engine, tag: str, order: list[str]):
        self.engine, self.tag, self.order, self.name = engine, tag, order, engine.name
        self.steps = getattr(engine, "steps", [])

    def generate(self, ids, max_tokens):
        self.order.append(self.tag)
        return self.engine.generate(ids, max_tokens)

    def counters(self):
        return self.engine.counters()


def bench(name: str, prompts: list[str]):
    return SimpleNamespace(name=name, prompts=prompts, max_tokens=12, source="test", sha256="0" * 64)


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_requests_alternate_until_the_pairs_are_there(tmp_path, temperature):
    target = random_target()
    draft = random_draft(target, [1, 2, 3])
    order: list[str] = []
    base = Recorded(ReferenceEngine(target, None, 0, None, temperature), "base", order)
    spec = Recorded(ReferenceEngine(target, draft, 3, None, temperature), "draft", order)
    res = run_benchmarks(spec, [bench("gsm8k", ["one two", "three four five"])], CharTokenizer(), tmp_path, "DSpark",
                         "dspark", 3, quiet=True, baseline=base, min_pairs=5, temperature=temperature)[0]
    assert order == ["base", "draft"] * 6  # 5 pairs over 2 prompts: three passes
    assert res.pairs == 6 and res.timing == "paired" and res.temperature == temperature
    assert res.speedup_lo <= res.speedup <= res.speedup_hi and res.baseline_tok_s > 0
    assert json.loads((tmp_path / "gsm8k.json").read_text())["speedup_hi"] == res.speedup_hi
    # The calibration report reads the first pass only: three greedy copies would triple the
    # count its noise floor assumes independent.
    assert res.calibration_steps and spec.steps[:len(res.calibration_steps)] == res.calibration_steps
    assert 2 * len(res.calibration_steps) < len(spec.steps)
    if temperature == 0:
        assert spec.steps == res.calibration_steps * 3


def test_spread_and_the_noise_flag_by_hand():
    assert ratio_spread([1.0, 2.0, 3.0, 4.0, 5.0]) == (3.0, 2.0, 4.0)
    assert ratio_spread([1.5]) == (1.5, 1.5, 1.5)
    assert implausible(7.32, 3.56) and not implausible(3.7, 3.56) and not implausible(2.0, None)


class Counted:
    """An engine that makes up its figures and counts its requests."""

    def __init__(self, name: str):
        self.name, self.requests = name, 0

    def generate(self, ids, max_tokens):
        self.requests += 1
        return 4, 0.5

    def counters(self):
        return ReferenceEngine(None).counters()


def test_a_result_is_reused_only_on_the_engine_and_timing_that_measured_it(tmp_path):
    """Run directories are named for the draft: a result measured on the reference loop must not
    come back as vLLM's, nor a cached-timing one as paired."""
    b = bench("gsm8k", ["one two"])
    first = Counted("reference")
    run_benchmarks(first, [b], CharTokenizer(), tmp_path, "DSpark", "dspark", 3, quiet=True)
    assert first.requests == 1 and finished(tmp_path, b, "reference", "cached") is not None
    again = Counted("reference")
    run_benchmarks(again, [b], CharTokenizer(), tmp_path, "DSpark", "dspark", 3, quiet=True)
    assert again.requests == 0  # a requeue: nothing re-measured
    other = Counted("vllm")
    [res] = run_benchmarks(other, [b], CharTokenizer(), tmp_path, "DSpark", "dspark", 3, quiet=True)
    assert other.requests == 1 and res.engine == "vllm"
    paired = Counted("vllm")
    [res] = run_benchmarks(paired, [b], CharTokenizer(), tmp_path, "DSpark", "dspark", 3, quiet=True,
                           baseline=Counted("vllm"), min_pairs=1)
    assert paired.requests == 1 and res.timing == "paired"
    assert finished(tmp_path, b, "vllm", "cached") is None and finished(tmp_path, b, "reference") is None


def test_a_cached_baseline_is_keyed_by_how_the_engine_serves():
    from hpc.config import load_config, to_object
    from hpc.evaluate.runner import baseline_key

    def key(engine: str, *overrides: str) -> str:
        cfg = to_object(load_config("configs/kimi-k2.6-dspark.yaml", list(overrides)))
        return baseline_key(cfg, engine, "v1", "8x H200", [SimpleNamespace(name="gsm8k", sha256="a" * 64)])

    assert key("vllm") != key("vllm", "verifier.tensor_parallel_size=4")
    assert key("vllm") != key("vllm", "verifier.extra_args=[--enforce-eager]")
    assert key("vllm") == key("vllm", "verifier.port=9000")  # where it listens changes no figure
    assert key("reference") != key("reference", "eval.device=cuda")
    assert key("reference") == key("reference", "verifier.tensor_parallel_size=4")  # vLLM's flags only


class Drafting(Counted):
    """Counts as vLLM's /metrics would: per request, 2 verify steps of 3 drafted tokens, 4 accepted."""

    def counters(self):
        r = self.requests
        return Counters(verify_steps=2 * r, drafted_tokens=6 * r, accepted_tokens=4 * r, accepted_per_pos=[2 * r] * 2)


def test_the_result_file_names_its_counts_for_what_they_count(tmp_path):
    b = bench("gsm8k", ["one two", "three"])
    [res] = run_benchmarks(Drafting("vllm"), [b], CharTokenizer(), tmp_path, "ngram", "ngram", 3, quiet=True)
    data = json.loads((tmp_path / "gsm8k.json").read_text())
    assert (data["verify_steps"], data["drafted_tokens"], data["accepted_tokens"]) == (4, 12, 8)
    assert "drafts" not in data and "accepted" not in data
    assert res.accept_len == data["accept_len"] == 1 + 8 / 4  # tokens per verify step, as before


OLD_FILE = {"benchmark": "gsm8k", "rows": 2, "sha256": "0" * 64, "source": "test", "engine": "vllm", "label": "ngram",
            "method": "ngram", "n": 3, "tok_s": 8.0, "output_tokens": 8, "wall_s": 1.0, "max_tokens": 12,
            "concurrency": 1, "drafts": 4, "accepted": 8, "accept_len": 3.0, "per_position": [0.5, 0.5, 0.0],
            "baseline_tok_s": None, "speedup": None, "speedup_lo": None, "speedup_hi": None, "pairs": 0,
            "timing": "cached", "temperature": 0.0, "calibration_steps": []}


def test_a_result_file_from_before_the_rename_still_loads_and_is_reused(tmp_path):
    old = BenchResult.from_json(OLD_FILE)
    assert (old.verify_steps, old.accepted_tokens, old.accept_len) == (4, 8, 3.0)
    assert old.drafted_tokens is None  # not kept then: unknown, not zero
    (tmp_path / "gsm8k.json").write_text(json.dumps(OLD_FILE))
    engine = Drafting("vllm")
    [res] = run_benchmarks(engine, [bench("gsm8k", ["one two"])], CharTokenizer(), tmp_path, "ngram", "ngram", 3,
                           quiet=True)
    assert engine.requests == 0 and res == old  # a requeue after the upgrade measures nothing again
