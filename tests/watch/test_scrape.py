"""Reading /metrics over real HTTP: the token only in the header, from the environment or an
owner-only file; endpoints that refuse, hang or answer garbage are named, not fatal. The bench's
local endpoint stands in for vLLM here (what vLLM exports is read in test_watch_vllm.py)."""

from __future__ import annotations

import os

import pytest

from hpc.errors import UserError
from hpc.watch.local_endpoints import MetricsServer
from hpc.watch.scrape import check_transport, read_token, scrape

METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 40.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 120.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 70.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 35.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 22.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 13.0
# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.7649e+09
"""


@pytest.fixture
def servers():
    made: list[MetricsServer] = []

    def make(body: str = METRICS, **kw) -> MetricsServer:
        made.append(MetricsServer(body=body, **kw))
        return made[-1]
    yield make
    for s in made:
        s.close()


def test_counters_and_start_time_are_read_with_the_token_in_the_header_only(servers):
    s = servers(token="tok-123")
    [r] = scrape([s.url + "/"], "tok-123", 5.0)
    assert r.error == "" and r.started == pytest.approx(1.7649e9)
    c = r.counters
    assert (c.verify_steps, c.drafted_tokens, c.accepted_tokens, c.accepted_per_pos) == (40, 120, 70, [35, 22, 13])
    assert s.seen[0]["path"] == "/metrics" and s.seen[0]["Authorization"] == "Bearer tok-123"


def test_failing_endpoints_are_named_and_the_rest_still_read(servers):
    good, locked, slow, broken = servers(), servers(token="right"), servers(delay_s=3.0), servers(status=500)
    garbage = servers(body="<html>gateway says hello</html>\n")
    plain = servers(body="# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n")
    got = scrape([good.url, locked.url, slow.url, broken.url, garbage.url, plain.url, "http://127.0.0.1:9"], "wrong",
                 1.0)
    assert [r.counters is not None for r in got] == [True, False, False, False, False, True, False]
    assert got[1].error == "refused the token" and got[2].error == "ReadTimeout" and got[3].error == "HTTP 500"
    assert got[4].error.startswith("not Prometheus metrics")  # a proxy's error page is not "no traffic"
    assert got[5].counters.verify_steps == 0  # metrics without spec decoding: nothing drafted, not an error
    assert got[6].error == "ConnectionError"


def test_the_token_comes_from_the_environment_or_an_owner_only_file(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVE_TOKEN", "  abc  \n")
    assert read_token("SERVE_TOKEN", None) == "abc"
    monkeypatch.delenv("SERVE_TOKEN")
    with pytest.raises(UserError, match="serve.token_env = SERVE_TOKEN: that variable is empty or not set"):
        read_token("SERVE_TOKEN", None)
    f = tmp_path / "token"
    f.write_text("file-token\n")
    os.chmod(f, 0o644)
    with pytest.raises(UserError, match=r"mode -rw-r--r--.*chmod 600"):
        read_token(None, str(f))
    os.chmod(f, 0o600)
    assert read_token(None, str(f)) == "file-token"
    f.write_text("")
    with pytest.raises(UserError, match="the file is empty"):
        read_token(None, str(f))
    with pytest.raises(UserError, match="cannot read it"):
        read_token(None, str(tmp_path / "missing"))
    assert read_token(None, None) is None


def test_a_token_is_not_sent_over_plain_http_unless_allowed():
    with pytest.raises(UserError, match=r"http://h:1 is plain http .* serve.allow_http=true"):
        check_transport(["https://a", "http://h:1"], "tok", allow_http=False)
    check_transport(["http://h:1"], "tok", allow_http=True)
    check_transport(["http://h:1"], None, allow_http=False)  # nothing to leak
