"""Regeneration through Ray-hosted servers: spreading, a server dying mid-run, servers that never come up.

Real Ray (a local cluster offering two "node" slots) and the real actors; the chat server behind
them is test_regenerate's fake, as these are error paths. Real vLLM on two Slurm nodes runs in
tests/launch/test_submit.py's end-to-end pipeline.
"""

from __future__ import annotations

import subprocess
import threading
import time
from types import SimpleNamespace

import pytest

from hpc.data.regen_ray import REGEN_RESOURCE, RegenServer, start_servers, stop_servers
from hpc.data.regen_shards import read_shards
from hpc.data.regenerate import regenerate, regenerated_dir
from hpc.errors import UserError
from tests.data.test_regenerate import FakeChat, fake_rows, fake_url, make_cfg  # noqa: F401 (fixture)

pytestmark = [pytest.mark.slow, pytest.mark.host_wide]  # real Ray workers: one Ray per host at a time


@pytest.fixture(scope="module")
def ray_two_slots():
    import ray

    ray.init(num_cpus=1, resources={REGEN_RESOURCE: 2}, include_dashboard=False, logging_level="WARNING",
             log_to_driver=False)
    yield ray
    ray.shutdown()


def test_requests_spread_over_the_servers_and_rows_keep_their_order(ray_two_slots, fake_url, tmp_path):
    cfg = make_cfg(tmp_path, fake_rows(tmp_path / "rows.jsonl", [f"p{i}" for i in range(12)]))
    lines: list[str] = []
    client = start_servers(cfg, 2, tmp_path, concurrency=2, url=fake_url, log=lines.append)
    try:
        stats = regenerate(cfg.data, "ray", shard_size=5, concurrency=4, client=client, log=lines.append)
    finally:
        stop_servers(client)
    assert stats.written == 12 and not stats.skipped
    assert [r["id"] for r in read_shards(regenerated_dir(cfg.data))] == [f"r{i}" for i in range(12)]
    assert sum(client.served) == 24 and all(n > 0 for n in client.served), client.served  # 2 turns a row
    assert "2 vLLM server(s) up" in lines[0]


def test_a_server_dying_mid_run_costs_no_row(ray_two_slots, fake_url, tmp_path):
    import ray

    cfg = make_cfg(tmp_path, fake_rows(tmp_path / "rows.jsonl", [f"p{i}" for i in range(40)]))
    lines: list[str] = []
    client = start_servers(cfg, 2, tmp_path, concurrency=2, url=fake_url, log=lines.append)

    def kill_one():
        while sum(client.served) < 10:
            time.sleep(0.01)
        ray.kill(client.actors[1])
    killer = threading.Thread(target=kill_one)
    killer.start()
    try:
        stats = regenerate(cfg.data, "ray", shard_size=16, concurrency=4, client=client, log=lines.append)
    finally:
        killer.join()
        stop_servers(client)
    assert stats.written == 40 and not stats.skipped  # in-flight requests went to the other server
    assert [r["id"] for r in read_shards(regenerated_dir(cfg.data))] == [f"r{i}" for i in range(40)]
    assert client.alive == [True, False] and "(died)" in client.summary()
    assert any("is gone" in line and "1 other(s)" in line for line in lines)


def test_no_live_server_left_stops_the_run_like_a_dead_server(ray_two_slots, fake_url, tmp_path):
    import ray

    cfg = make_cfg(tmp_path, fake_rows(tmp_path / "rows.jsonl", [f"p{i}" for i in range(8)]))
    client = start_servers(cfg, 2, tmp_path, concurrency=1, url=fake_url, log=lambda _: None)
    for actor in client.actors:
        ray.kill(actor)
    with pytest.raises(UserError, match="no regeneration server is left alive"):
        regenerate(cfg.data, "ray", shard_size=4, concurrency=2, client=client, log=lambda _: None)
    # Not skipped rows: nothing written, so a re-run asks for every row again.
    assert not list(regenerated_dir(cfg.data).glob("shard-*"))


def test_a_dead_vllm_behind_a_live_actor_is_reported_dead_not_a_failed_row(fake_url, tmp_path):
    cfg = make_cfg(tmp_path, fake_rows(tmp_path / "rows.jsonl", ["a"]))
    srv = RegenServer(cfg, str(tmp_path), url=fake_url)
    srv.client.backoff = 0.01
    assert srv.complete([{"role": "user", "content": "FAIL"}], None)[:2] == ("failed", "request_failed")
    dead = subprocess.Popen(["true"])
    dead.wait()
    srv.server = SimpleNamespace(proc=dead, log_path=tmp_path / "vllm.log")
    status, reason, detail = srv.complete([{"role": "user", "content": "FAIL"}], None)
    assert (status, reason) == ("dead", "server_died") and "vllm.log" in detail


def test_servers_that_never_come_up_are_named_and_the_rest_carry_on(ray_two_slots, fake_url, tmp_path):
    cfg = make_cfg(tmp_path, fake_rows(tmp_path / "rows.jsonl", ["a"]))
    lines: list[str] = []
    # Three servers asked of two slots: the third never gets a node and times out. The deadline also bounds
    # the first two, whose worker processes start and import hpc under whatever load the machine has (5 s was
    # too short beside a CI suite), so it is generous; only the third ever waits it out.
    client = start_servers(cfg, 3, tmp_path, concurrency=1, url=fake_url, timeout_s=30, log=lines.append)
    try:
        assert len(client.actors) == 2
        assert any("warning: server 2: GetTimeoutError" in line and "going on with 2" in line for line in lines)
    finally:
        stop_servers(client)
    with pytest.raises(UserError, match="no regeneration server came up") as err:
        start_servers(cfg, 2, tmp_path, concurrency=1, url="http://127.0.0.1:9", timeout_s=60, log=lines.append)
    assert "server 0" in str(err.value) and "server 1" in str(err.value)
