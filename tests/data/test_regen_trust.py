"""Regenerated data is private and hashed: a 0700 directory, each shard's sha256 in the manifest,
and a shard that changed (or a file planted beside them) is one line naming it, before a resume
builds on it or training reads a row."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import pytest

from hpc.data.regen_client import ChatClient
from hpc.data.regen_shards import MANIFEST, ShardStore, verify_shards
from hpc.data.regenerate import regenerate, regenerated_dir
from hpc.errors import UserError
from tests.data.test_regenerate import MAX_TOKENS, fake_rows, fake_url, make_cfg  # noqa: F401 (a fixture)


def _regenerated(tmp_path: Path, url: str, prompts=("a", "b", "c", "d", "e")) -> Path:
    cfg = make_cfg(tmp_path, fake_rows(tmp_path / "rows.jsonl", list(prompts)))
    regenerate(cfg.data, url, shard_size=2, client=ChatClient(url, "fake", MAX_TOKENS))
    return regenerated_dir(cfg.data)


def test_the_directory_is_private_and_the_manifest_hashes_every_shard(fake_url, tmp_path):
    root = _regenerated(tmp_path, fake_url)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    shards = json.loads((root / MANIFEST).read_text())["shards"]
    assert [s["name"] for s in shards] == ["shard-00000.jsonl", "shard-00001.jsonl", "shard-00002.jsonl"]
    for s in shards:
        path = root / s["name"]
        assert s["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    verify_shards(root)  # as written: trusted


@pytest.mark.parametrize("tamper", ["edit", "append", "truncate"])
def test_a_changed_shard_is_one_line_for_training_and_for_a_resume(fake_url, tmp_path, tamper):
    root = _regenerated(tmp_path, fake_url)
    shard = root / "shard-00001.jsonl"
    text = shard.read_text()
    if tamper == "edit":  # a poisoned reply, same length
        shard.write_text(text.replace("reply", "REPLY", 1))
    elif tamper == "append":  # one more (on-policy-looking) row
        shard.write_text(text + text.splitlines()[0] + "\n")
    else:
        shard.write_text(text[: len(text) // 2])
    with pytest.raises(UserError, match=r"shard-00001\.jsonl changed after it was regenerated"):
        verify_shards(root)
    settings = json.loads((root / MANIFEST).read_text())["settings"]
    with pytest.raises(UserError, match=r"shard-00001\.jsonl changed after it was regenerated"):
        ShardStore(root, settings["shard_size"], {k: v for k, v in settings.items() if k != "shard_size"}).open()


@pytest.mark.parametrize("name", ["shard-00003.jsonl", "extra.jsonl", "more.parquet"])
def test_a_file_planted_beside_the_shards_is_refused(fake_url, tmp_path, name):
    """A reader takes every *.jsonl and *.parquet in the folder: one the manifest does not list
    would be trained on."""
    root = _regenerated(tmp_path, fake_url)
    (root / name).write_text((root / "shard-00000.jsonl").read_text())
    with pytest.raises(UserError, match=f"{name} is not one of the regenerated shards"):
        verify_shards(root)


def test_shards_from_before_hashes_are_not_trusted(fake_url, tmp_path):
    root = _regenerated(tmp_path, fake_url)
    manifest = json.loads((root / MANIFEST).read_text())
    for s in manifest["shards"]:
        del s["sha256"]
    (root / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="records no hash .* run the regenerate stage again"):
        verify_shards(root)


def test_an_open_directory_is_tightened_and_a_swappable_parent_refused(fake_url, tmp_path):
    root = _regenerated(tmp_path, fake_url)
    os.chmod(root, 0o775)  # a group member could read replies, or drop a shard in
    cfg = make_cfg(tmp_path, tmp_path / "rows.jsonl")
    regenerate(cfg.data, fake_url, shard_size=2, client=ChatClient(fake_url, "fake", MAX_TOKENS))  # complete: a no-op
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # others may rename our directory away and put theirs in its place
    cfg = make_cfg(shared, tmp_path / "rows.jsonl")
    with pytest.raises(UserError, match="data.output_dir: .* writable by other users .* without the sticky bit"):
        regenerate(cfg.data, fake_url, shard_size=2, client=ChatClient(fake_url, "fake", MAX_TOKENS))


def test_training_reads_only_verified_shards(fake_url, tmp_path, toy_target):
    """The prepare step (what `dspark train` and the train stage run) checks before it reads."""
    from hpc.config import load_config, to_object
    from hpc.data.prepare import prepare_data

    root = _regenerated(tmp_path, fake_url)
    cfg = to_object(load_config(str(Path(__file__).resolve().parents[2] / "configs/toy-cpu.yaml"), [
        f"verifier.model={toy_target}", f"data.sources=[{{path: {tmp_path / 'rows.jsonl'}}}]",
        f"data.output_dir={root.parent}", f"train.output_dir={tmp_path / 'run'}", "data.regenerate=true"]))
    prepare_data(cfg)  # as written: read
    (root / "shard-00002.jsonl").write_text('{"messages": [{"role": "user", "content": "x"}]}\n')
    with pytest.raises(UserError, match=r"shard-00002\.jsonl changed after it was regenerated"):
        prepare_data(cfg)
