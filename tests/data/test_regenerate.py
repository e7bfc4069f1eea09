"""`dspark regenerate`: real vLLM on the toy target (the session's `regen_server`), fakes only for errors."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests

from hpc.config import load_config, to_object
from hpc.data.regen_client import ChatClient
from hpc.data.regen_shards import MANIFEST, ShardStore, read_shards
from hpc.data.regenerate import ordered_map, plan_turns, regenerate, regenerated_dir
from hpc.errors import UserError
from hpc_dev.toy_data import toy_conversations
from tests.fixtures.wait import poll

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 16


def conv(*turns: tuple[str, str]) -> list[dict]:
    return [{"from": who, "value": text} for who, text in turns]


def write_rows(path: Path) -> Path:
    """12 rows: 7 single-turn, 2 multi-turn, 1 prompt-only, 1 without a user turn, 1 malformed."""
    rows = toy_conversations(7, seed=1)
    rows.append({"id": "multi-sys", "source": "t", "conversations": conv(
        ("system", "You write Python."), ("human", "def parse(text):"), ("gpt", "ORIGINAL ONE"),
        ("human", "Now add a docstring."), ("gpt", "ORIGINAL TWO"))})
    rows.append({"id": "multi-3", "source": "t", "conversations": conv(
        ("human", "import os"), ("gpt", "ORIGINAL A"), ("human", "class Foo:"), ("gpt", "ORIGINAL B"),
        ("human", "    def __init__(self"), ("gpt", "ORIGINAL C"))})
    rows.append({"id": "no-user", "conversations": conv(("system", "hi"), ("gpt", "hello"))})
    rows.append({"id": "bad", "conversations": conv(("tool", "x"))})
    rows.append({"id": "prompt-only", "messages": [{"role": "user", "content": "for i in range("}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


WRITTEN = [0, 1, 2, 3, 4, 5, 6, 7, 8, 11]  # input rows that must come out, in this order


def make_cfg(tmp_path: Path, data: Path, *extra: str):
    # Typed but not path-validated: the fake-server tests need no toy target on disk.
    return to_object(load_config(str(ROOT / "configs/toy-cpu.yaml"), [
        f"data.sources=[{{path: {data}}}]", f"data.output_dir={tmp_path / 'out'}",
        f"data.regen_max_tokens={MAX_TOKENS}", *extra]))


def greedy(url: str, key: str, messages: list[dict]) -> str:
    auth = {"Authorization": f"Bearer {key}"}
    model = requests.get(f"{url}/v1/models", timeout=30, headers=auth).json()["data"][0]["id"]
    resp = requests.post(f"{url}/v1/chat/completions", timeout=120, headers=auth, json={
        "model": model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0})
    resp.raise_for_status()
    return resp.json()["choices"][0]["message"]["content"] or ""


# --- pure logic -------------------------------------------------------------------------------

def test_plan_turns_keeps_system_and_user_and_places_replies():
    u, s, a = ({"role": r, "content": r[0]} for r in ("user", "system", "assistant"))
    assert plan_turns([s, u, a, u, a]) == [[s, u], [u]]
    assert plan_turns([u, a, a, u]) == [[u], [u]]  # a run of assistant turns: one reply; final user gets one
    assert plan_turns([s, a, u, a]) == [[s, u]]  # no reply before the first user turn
    assert plan_turns([u, a, s]) == [[u]]  # a trailing system turn teaches nothing
    assert plan_turns([s, a]) == []


def test_ordered_map_keeps_input_order_under_concurrency():
    def slow(i: int) -> int:
        time.sleep(random.random() * 0.01)
        return i * i

    assert list(ordered_map(slow, range(50), workers=4)) == [i * i for i in range(50)]


def test_store_refuses_shards_without_manifest_and_drops_partial_writes(tmp_path):
    store = ShardStore(tmp_path, 2, {"model": "m"})
    assert store.open() == 0
    store.write(0, 2, [{"row": 0}, {"row": 1}], {})
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = socket.gethostname()
    (tmp_path / f".shard-00001.jsonl.tmp-{host}-{int(dead.stdout)}-0123abcd").write_text("{half")  # killed mid-file
    live = tmp_path / f".shard-00001.jsonl.tmp-{host}-{os.getpid()}-0123abcd"  # another writer, still at work
    live.write_text("{half")
    again = ShardStore(tmp_path, 2, {"model": "m"})
    assert again.open() == 2 and list(tmp_path.glob(".*tmp*")) == [live]
    live.unlink()
    (tmp_path / MANIFEST).unlink()
    with pytest.raises(UserError, match="no manifest.json"):
        ShardStore(tmp_path, 2, {"model": "m"}).open()


# --- real vLLM on the toy target --------------------------------------------------------------

@pytest.mark.slow
def test_turns_are_the_targets_greedy_replies_to_the_regenerated_history(regen_server, tmp_path):
    url, over, key = regen_server
    cfg = make_cfg(tmp_path, write_rows(tmp_path / "rows.jsonl"), *over)
    stats = regenerate(cfg.data, url, api_key=key, shard_size=4, concurrency=1)
    assert (stats.written, dict(stats.skipped), stats.shards) == (10, {"no_user_turn": 1, "malformed": 1}, 3)
    rows = read_shards(regenerated_dir(cfg.data))
    assert [r["row"] for r in rows] == WRITTEN
    multi = next(r for r in rows if r["id"] == "multi-sys")
    msgs = multi["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert [msgs[0]["content"], msgs[1]["content"], msgs[3]["content"]] == [
        "You write Python.", "def parse(text):", "Now add a docstring."]
    assert "ORIGINAL" not in msgs[2]["content"] + msgs[4]["content"]
    assert msgs[2]["content"] == greedy(url, key, msgs[:2])
    # The second turn answers the regenerated first turn: re-asking with it gives the same text.
    assert msgs[4]["content"] == greedy(url, key, msgs[:4])
    three = next(r for r in rows if r["id"] == "multi-3")["messages"]
    assert [m["role"] for m in three] == ["user", "assistant"] * 3
    assert three[5]["content"] == greedy(url, key, three[:5])
    assert next(r for r in rows if r["id"] == "prompt-only")["messages"][1]["role"] == "assistant"
    print(f"\nconcurrency 1: {stats.summary()}")


@pytest.mark.slow
def test_concurrency_does_not_change_shard_contents_order(regen_server, tmp_path):
    url, over, key = regen_server
    cfg = make_cfg(tmp_path, write_rows(tmp_path / "rows.jsonl"), *over)
    stats = regenerate(cfg.data, url, api_key=key, shard_size=4, concurrency=4)
    shards = sorted(p.name for p in regenerated_dir(cfg.data).glob("shard-*.jsonl"))
    assert shards == ["shard-00000.jsonl", "shard-00001.jsonl", "shard-00002.jsonl"]
    by_shard = [[r["row"] for r in read_shards_of(regenerated_dir(cfg.data) / s)] for s in shards]
    assert by_shard == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 11]]
    # Batched requests give the solo greedy reply (fp32 on CPU; on GPUs batching may flip near-ties).
    last = read_shards(regenerated_dir(cfg.data))[-1]["messages"]
    assert last[-1]["content"] == greedy(url, key, last[:-1])
    print(f"\nconcurrency 4: {stats.summary()}")


def read_shards_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_killed_run_resumes_without_duplicates_or_gaps(regen_server, tmp_path):
    url, over, key = regen_server
    data = write_rows(tmp_path / "rows.jsonl")
    cfg = make_cfg(tmp_path, data, *over)
    out = regenerated_dir(cfg.data)
    cmd = [sys.executable, "-m", "hpc", "regenerate", str(ROOT / "configs/toy-cpu.yaml"),
           f"data.sources=[{{path: {data}}}]", f"data.output_dir={tmp_path / 'out'}",
           f"data.regen_max_tokens={MAX_TOKENS}", *over, "--server-url", url, "--shard-size", "4",
           "--concurrency", "1", "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "VLLM_API_KEY": key})  # an existing server's key
    def shards_in_manifest() -> int:
        # The manifest, not the shard file, says a shard is complete: a kill between the two
        # (shard written, manifest not yet) rightly costs that shard, so wait for the manifest.
        m = out / MANIFEST
        return len(json.loads(m.read_text())["shards"]) if m.exists() else 0

    poll(lambda: shards_in_manifest() or proc.poll() is not None, bool, 120, 0.01)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)  # mid-shard 1: as a preempted Slurm job dies
    log = proc.communicate()[0].decode(errors="replace")
    done = sorted(p.name for p in out.glob("shard-*.jsonl"))
    assert done and done[0] == "shard-00000.jsonl" and len(done) < 3, log
    stats = regenerate(cfg.data, url, api_key=key, shard_size=4, concurrency=2)
    assert stats.resumed_shards >= 1 and stats.resumed_rows == 4 * stats.resumed_shards
    rows = read_shards(out)
    assert [r["row"] for r in rows] == WRITTEN  # each row once, in order
    assert not list(out.glob(".*tmp*"))
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["finished"] and [s["written"] for s in manifest["shards"]] == [4, 4, 2]


@pytest.mark.slow
def test_row_limit_then_full_run_redoes_only_the_short_shard(regen_server, tmp_path):
    url, over, key = regen_server
    cfg = make_cfg(tmp_path, write_rows(tmp_path / "rows.jsonl"), *over)
    first = regenerate(cfg.data, url, api_key=key, shard_size=4, concurrency=4, max_rows=6)
    assert (first.written, first.shards) == (6, 2)  # shard 1 is short: rows 4..5
    second = regenerate(cfg.data, url, api_key=key, shard_size=4, concurrency=4)
    assert (second.resumed_shards, second.resumed_rows, second.shards) == (1, 4, 2)
    assert [r["row"] for r in read_shards(regenerated_dir(cfg.data))] == WRITTEN
    third = regenerate(cfg.data, url, api_key=key, shard_size=4, concurrency=4)
    assert (third.written, third.shards, third.resumed_rows) == (0, 0, 12)
    with pytest.raises(UserError, match="shard_size"):
        regenerate(cfg.data, url, api_key=key, shard_size=5)


# --- error paths: a fake OpenAI-compatible server ----------------------------------------------

class FakeChat(BaseHTTPRequestHandler):
    """Replies `reply-N` (N = messages in the request); FAIL -> 500, REJECT -> 400, FLAKY -> one 503,
    BUSY -> 429 with Retry-After: 1."""

    seen: Counter = Counter()
    requests: list[list[dict]] = []

    def log_message(self, *args) -> None:  # keep pytest output clean
        pass

    def _send(self, code: int, body: dict, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._send(200, {"data": [{"id": "fake"}]})

    def do_POST(self) -> None:
        msgs = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["messages"]
        last = msgs[-1]["content"]
        FakeChat.seen[last] += 1
        FakeChat.requests.append(msgs)
        if "FAIL" in last:
            return self._send(500, {"error": "boom"})
        if "REJECT" in last:
            return self._send(400, {"error": "prompt too long"})
        if "FLAKY" in last and FakeChat.seen[last] == 1:
            return self._send(503, {"error": "busy"})
        if "BUSY" in last:
            return self._send(429, {"error": "slow down"}, {"Retry-After": "1"})
        self._send(200, {"choices": [{"message": {"role": "assistant", "content": f"reply-{len(msgs)}"},
                                      "finish_reason": "stop"}]})


@pytest.fixture
def fake_url():
    FakeChat.seen, FakeChat.requests = Counter(), []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeChat)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def fake_rows(path: Path, prompts: list[str]) -> Path:
    rows = [{"id": f"r{i}", "conversations": conv(("human", p), ("gpt", "orig"), ("human", "more"), ("gpt", "orig"))}
            for i, p in enumerate(prompts)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_failing_requests_cost_only_their_rows(fake_url, tmp_path):
    cfg = make_cfg(tmp_path, fake_rows(tmp_path / "rows.jsonl", ["ok", "FAIL", "REJECT", "FLAKY", "ok2", "ok3"]))
    client = ChatClient(fake_url, "fake", MAX_TOKENS, retries=2, backoff=0.01)
    stats = regenerate(cfg.data, fake_url, shard_size=4, concurrency=3, client=client)
    assert stats.written == 4 and dict(stats.skipped) == {"request_failed": 1, "rejected": 1}
    assert FakeChat.seen["FAIL"] == 3 and FakeChat.seen["REJECT"] == 1  # 5xx retried, 4xx not
    rows = read_shards(regenerated_dir(cfg.data))
    assert [r["id"] for r in rows] == ["r0", "r3", "r4", "r5"]  # FLAKY got through on its retry
    # Turn 2 was asked with the regenerated turn 1, never the original.
    second = [m for m in FakeChat.requests if len(m) == 3]
    assert second and all(m[1] == {"role": "assistant", "content": "reply-1"} for m in second)
    assert rows[0]["messages"][-1] == {"role": "assistant", "content": "reply-3"}


def test_retries_honour_retry_after_then_give_up_in_one_line(fake_url):
    from hpc.data.regen_client import RequestFailed

    client = ChatClient(fake_url, "fake", MAX_TOKENS, retries=1, backoff=0.0)
    start = time.monotonic()
    with pytest.raises(RequestFailed) as err:
        client.complete([{"role": "user", "content": "BUSY"}])
    assert time.monotonic() - start >= 1.0  # the server's Retry-After, though backoff is 0
    assert FakeChat.seen["BUSY"] == 2
    assert err.value.reason == "request_failed"
    assert str(err.value) == 'request_failed: 2 attempts, last: HTTP 429: {"error": "slow down"}'


def test_dropped_and_refused_connections_are_retried_then_reported_in_one_line():
    from hpc.data.regen_client import RequestFailed
    from hpc.net import free_port

    # A server that reads each request and hangs up without a reply: a POST retried all the same.
    accepted = []
    with socket.socket() as lsock:
        lsock.bind(("127.0.0.1", 0))
        lsock.listen()

        def hang_up():
            while True:
                try:
                    conn, _ = lsock.accept()
                except OSError:
                    return
                accepted.append(conn.recv(65536))
                conn.close()
        threading.Thread(target=hang_up, daemon=True).start()
        client = ChatClient(f"http://127.0.0.1:{lsock.getsockname()[1]}", "fake", MAX_TOKENS, retries=2, backoff=0.0)
        with pytest.raises(RequestFailed) as err:
            client.complete([{"role": "user", "content": "hi"}])
    assert len(accepted) == 3 and all(r.startswith(b"POST /v1/chat/completions") for r in accepted)
    assert err.value.reason == "request_failed" and "3 attempts, last: ConnectionError" in err.value.detail
    # Nothing listening: connect errors count against the same retries, and the error stays one line.
    client = ChatClient(f"http://127.0.0.1:{free_port()}", "fake", MAX_TOKENS, retries=2, backoff=0.0)
    with pytest.raises(RequestFailed) as err:
        client.complete([{"role": "user", "content": "hi"}])
    assert err.value.reason == "request_failed" and "\n" not in str(err.value)
    assert "3 attempts, last: ConnectionError" in err.value.detail and "Connection refused" in err.value.detail


def test_dead_server_stops_the_run_without_writing_the_shard_in_progress(fake_url, tmp_path):
    cfg = make_cfg(tmp_path, fake_rows(tmp_path / "rows.jsonl", ["a", "b", "c", "d"] + ["FAIL"] * 6))
    client = ChatClient(fake_url, "fake", MAX_TOKENS, retries=0, backoff=0.0)
    with pytest.raises(UserError, match="server down"):
        regenerate(cfg.data, fake_url, shard_size=4, concurrency=1, client=client, max_consecutive_failures=3)
    assert sorted(p.name for p in regenerated_dir(cfg.data).glob("shard-*")) == ["shard-00000.jsonl"]


def test_a_server_that_dies_at_a_shard_boundary_loses_no_row(fake_url, tmp_path):
    """The run of failures began in the shard before: written then, its rows were skipped for good."""
    cfg = make_cfg(tmp_path, fake_rows(tmp_path / "rows.jsonl", ["a", "b", "c", "FAIL", "FAIL", "FAIL", "e", "f"]))
    client = ChatClient(fake_url, "fake", MAX_TOKENS, retries=0, backoff=0.0)
    with pytest.raises(UserError, match="server down"):
        regenerate(cfg.data, fake_url, shard_size=4, concurrency=1, client=client, max_consecutive_failures=3)
    assert list(regenerated_dir(cfg.data).glob("shard-*")) == []  # rows 0-3 wait for the run to end
    # The server is back: every row is asked again, none was written off as skipped.
    cfg2 = make_cfg(tmp_path, fake_rows(tmp_path / "rows.jsonl", ["a", "b", "c", "d", "d2", "d3", "e", "f"]))
    stats = regenerate(cfg2.data, fake_url, shard_size=4, concurrency=1, client=client)
    assert stats.written == 8 and not stats.skipped


def test_a_finished_regeneration_is_complete_only_for_its_own_sources(fake_url, tmp_path):
    from hpc.data.regenerate import regeneration_complete

    cfg = make_cfg(tmp_path, fake_rows(tmp_path / "rows.jsonl", ["a", "b", "c"]))
    assert not regeneration_complete(cfg.data)
    regenerate(cfg.data, fake_url, shard_size=2, client=ChatClient(fake_url, "fake", MAX_TOKENS))
    assert regeneration_complete(cfg.data)
    other = make_cfg(tmp_path, fake_rows(tmp_path / "more.jsonl", ["a", "b", "c", "d"]))
    assert not regeneration_complete(other.data)  # same output directory, other data: not done


@pytest.mark.parametrize("flag,value", [("--shard-size", "0"), ("--max-rows", "-1"), ("--concurrency", "0")])
def test_bad_regenerate_options_fail_before_the_config_or_a_server(flag, value):
    # The config does not even exist: the options are checked before it is read or vLLM starts.
    res = subprocess.run([sys.executable, "-m", "hpc", "regenerate", "/no/such.yaml", flag, value],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert f"error: {flag} {value}: must be at least 1 (leave it out for" in res.stderr, res.stderr
