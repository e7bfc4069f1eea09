"""Target resolution: local directories, hub ids from the HF cache (offline), and the one-line errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hpc.config import ConfigError
from hpc.config.target import localize, offline_mode, resolve_target
from hpc.errors import UserError
from hpc.launch.launch_checks import resolve
from tests.fixtures.recipes import resolve_recipe

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, toy_target):
    """A Hugging Face cache holding `acme/toy` at COMMIT (what `hf download` leaves), no network."""
    cache = tmp_path / "hub"
    repo = cache / "models--acme--toy"
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    for f in toy_target.iterdir():
        if f.is_file():
            (snap / f.name).write_bytes(f.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return snap


def test_a_local_directory_is_itself(toy_target):
    assert resolve_target(str(toy_target)) == toy_target


def test_a_hub_id_resolves_to_its_cached_snapshot_offline(hub_cache):
    assert resolve_target("acme/toy", offline=True) == hub_cache
    assert resolve_target("acme/toy", revision=COMMIT, offline=True) == hub_cache


def test_an_unknown_id_offline_is_one_line_naming_the_id_and_the_mode(hub_cache, monkeypatch):
    with pytest.raises(UserError) as info:
        resolve_target("acme/nope", revision="v1", offline=True)
    msg = str(info.value)
    assert "\n" not in msg and "'acme/nope' at revision v1: cannot resolve the hub id" in msg
    assert "offline mode is on" in msg and "hf download acme/nope" in msg
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the environment decides when the config does not
    assert offline_mode(None) and not offline_mode(False)
    with pytest.raises(UserError, match="not a hub id"):
        resolve_target("./missing/dir")


def test_localize_keeps_the_hub_id_as_the_name(hub_cache, toy_target):
    cfg = resolve_recipe("configs/toy-cpu.yaml", ["verifier.model=acme/toy", "verifier.offline=true",
                                                  "data.sources=[{path: toy/chat}]"])
    local = localize(cfg)
    assert local.verifier.model == str(hub_cache) and local.verifier.name == "acme/toy"
    assert cfg.verifier.model == "acme/toy"  # the caller's config is unchanged


def test_validate_reads_a_cached_hub_target_and_checks_it(hub_cache):
    # The toy target has 4 layers: its cached config.json is read (no network) and an aux id past it caught.
    with pytest.raises(ConfigError) as info:
        resolve_recipe("configs/toy-cpu.yaml", ["verifier.model=acme/toy", "verifier.aux_layer_ids=[1,2,9]",
                                                "data.sources=[{path: toy/chat}]"])
    assert any("id 9 outside 0..4" in p and str(hub_cache / "config.json") in p for p in info.value.problems)


def test_every_server_gets_offline_mode_only_when_the_config_sets_it():
    from hpc.config.schema import VerifierConfig
    from hpc.verifier.vllm_server import DEFAULT_ENV, server_env

    assert "HF_HUB_OFFLINE" not in DEFAULT_ENV
    assert "HF_HUB_OFFLINE" not in server_env(VerifierConfig())
    assert server_env(VerifierConfig(offline=True))["HF_HUB_OFFLINE"] == "1"
    assert server_env(VerifierConfig(offline=False, env={"HF_TOKEN": "x"})) == {"HF_TOKEN": "x", "HF_HUB_OFFLINE": "0"}


def test_in_a_job_node_0_resolves_and_the_other_nodes_read_its_path(hub_cache, tmp_path):
    from hpc.launch.node_setup import localize_in_job
    from hpc.launch.slurm_env import SlurmEnv

    cfg = resolve_recipe("configs/toy-cpu.yaml", ["verifier.model=acme/toy", "verifier.offline=true",
                                                  f"cluster.log_dir={tmp_path / 'logs'}", "verifier.health_timeout_s=1",
                                                  "data.sources=[{path: toy/chat}]"])
    node = lambda i: SlurmEnv(job_id=42, node_index=i, n_nodes=2, hostnames=["a", "b"], requeue_id="42")  # noqa: E731
    marker = tmp_path / "logs" / ".target-42"
    first = localize_in_job(cfg, node(0))
    assert first.verifier.model == str(hub_cache) and json.loads(marker.read_text())["path"] == str(hub_cache)
    (hub_cache.parent / "elsewhere").mkdir()  # node 1 never resolves: it takes node 0's answer
    marker.write_text(json.dumps({"model": "acme/toy", "revision": None, "path": str(hub_cache.parent / "elsewhere")}))
    second = localize_in_job(cfg, node(1))
    assert second.verifier.model == str(hub_cache.parent / "elsewhere") and second.verifier.name == "acme/toy"


def test_a_stale_marker_of_a_reused_job_id_is_not_taken(hub_cache, tmp_path):
    """A reset cluster counts job ids from 1 again: job 42's marker from another pipeline named
    another target, and node 1 took its path without a word."""
    import threading

    from hpc.launch.node_setup import localize_in_job
    from hpc.launch.slurm_env import SlurmEnv

    cfg = resolve_recipe("configs/toy-cpu.yaml", ["verifier.model=acme/toy", "verifier.offline=true",
                                                  f"cluster.log_dir={tmp_path / 'logs'}", "verifier.health_timeout_s=1",
                                                  "data.sources=[{path: toy/chat}]"])
    node = lambda i: SlurmEnv(job_id=42, node_index=i, n_nodes=2, hostnames=["a", "b"], requeue_id="42")  # noqa: E731
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / ".target-42").write_text(json.dumps({"model": "acme/toy", "revision": None,
                                                               "path": "/gone/snapshot"}))
    (tmp_path / "logs" / ".target-42.error").write_text(json.dumps({"model": "acme/toy", "revision": None,
                                                                    "error": "stale failure"}))
    for f in (tmp_path / "logs").iterdir():  # last month's job 42, on the same target
        os.utime(f, (f.stat().st_mtime - 30 * 86400,) * 2)
    got = {}
    reader = threading.Thread(target=lambda: got.update(cfg=localize_in_job(cfg, node(1))), daemon=True)
    reader.start()
    reader.join(1.5)
    assert reader.is_alive()  # neither stale file answers for this job: it waits for node 0
    localize_in_job(cfg, node(0))
    reader.join(10)
    assert got["cfg"].verifier.model == str(hub_cache)


def test_a_node_0_failure_stops_the_other_nodes_at_once(hub_cache, tmp_path):
    from hpc.launch.node_setup import localize_in_job
    from hpc.launch.slurm_env import SlurmEnv

    cfg = resolve_recipe("configs/toy-cpu.yaml", ["verifier.model=acme/missing", "verifier.offline=true",
                                                  f"cluster.log_dir={tmp_path / 'logs'}",
                                                  "data.sources=[{path: toy/chat}]"])
    node = lambda i: SlurmEnv(job_id=7, node_index=i, n_nodes=2, hostnames=["a", "b"], requeue_id="7")  # noqa: E731
    with pytest.raises(UserError, match="cannot resolve the hub id"):
        localize_in_job(cfg, node(0))
    with pytest.raises(UserError, match="node 0 failed: verifier.model = 'acme/missing'"):
        localize_in_job(cfg, node(1))  # no hour-long wait for a marker that never comes


def test_a_directory_named_like_a_hub_id_does_not_shadow_it(tmp_path, monkeypatch):
    """`moonshotai/Kimi-K2.6/` in the current directory (a co-user's, in a shared one) was loaded
    as the target, with trust_remote_code. A hub id stays a hub id; `./` names the directory."""
    from hpc.config.target import is_local

    monkeypatch.chdir(tmp_path)
    (tmp_path / "moonshotai" / "Kimi-K2.6").mkdir(parents=True)
    assert not is_local("moonshotai/Kimi-K2.6")
    assert is_local("./moonshotai/Kimi-K2.6") and is_local(str(tmp_path / "moonshotai" / "Kimi-K2.6"))
    with pytest.raises(ConfigError) as err:
        resolve(str(Path(__file__).resolve().parents[2] / "configs/kimi-k2.6-dspark.yaml"), check_tracking=False)
    line = next(x for x in str(err.value).splitlines() if x.startswith("verifier.model"))
    assert "names a hub id, and ./moonshotai/Kimi-K2.6 exists here too; write ./moonshotai/Kimi-K2.6" in line
