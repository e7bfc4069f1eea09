"""What `dspark watch`, `dspark retrain-tick` and `dspark schedule list` trust (issue 46): the
watch's state and a tick's record are read only when they are this user's plain files that
nobody else may write, and a tracking store they only read is never created or written."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hpc.errors import UserError
from hpc.launch import retrain
from hpc.launch.retrain import LAST_SUFFIX
from hpc.launch.schedule import last_tick
from hpc.watch.drift import WatchState
from hpc.watch.tick import load_state, save_state
from tests.launch.test_schedule import CONFIG, toy_overrides


def planted(path: Path, how: str, text: str) -> Path:
    """`path` made the way another user, or a careless one, could leave it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if how == "symlink":  # pointing at a file the planter controls
        target = path.parent / "elsewhere.json"
        target.write_text(text)
        os.chmod(target, 0o600)
        path.symlink_to(target)
        return path
    path.write_text(text)
    if how == "others-write":
        os.chmod(path, 0o666)
    elif how == "group-write":
        os.chmod(path, 0o620)
    elif how == "foreign":
        os.chmod(path, 0o600)
        os.chown(path, 65534, 65534)
    return path


@pytest.mark.parametrize("how", ["symlink", "others-write", "group-write", "foreign"])
def test_a_planted_watch_state_is_one_line_and_never_read(tmp_path, how):
    # A planted state could hold a retrain back (a cooldown) or fire one early: it must not count.
    path = planted(tmp_path / "watch" / "toy.watch.json", how, json.dumps({"ticks": 99, "last_fire": None}))
    with pytest.raises(UserError, match="not trusted") as err:
        load_state(path)
    assert "\n" not in str(err.value) and "delete the file" in str(err.value)


def test_the_watch_state_round_trips_and_a_torn_one_is_one_line(tmp_path):
    path = tmp_path / "watch" / "toy.watch.json"
    assert load_state(path) == WatchState()  # none yet: a fresh watch
    state = WatchState(ticks=2, last_fire=1.8e9, champion="3")
    save_state(path, state)
    assert load_state(path) == state and os.stat(path).st_mode & 0o777 == 0o600
    for text in ("{", "[1, 2]", "null", '"text"'):
        path.write_text(text)
        with pytest.raises(UserError, match="not a watch state"):
            load_state(path)


@pytest.mark.parametrize("how", ["symlink", "others-write", "foreign"])
def test_schedule_list_shows_a_planted_tick_record_as_untrusted(tmp_path, how):
    planted(tmp_path / f"toy{LAST_SUFFIX}", how, json.dumps({"trigger": "cron", "at": 0, "lines": ["retrained"]}))
    said = last_tick(str(tmp_path), "toy")
    assert said.startswith("last tick record not trusted") and "retrained" not in said


@pytest.mark.parametrize("text", ["{", "[]", '{"at": "soon"}', '{"at": 1e300}', '{"lines": 5}'])
def test_a_torn_tick_record_is_unreadable_not_a_traceback(tmp_path, text):
    path = tmp_path / f"toy{LAST_SUFFIX}"
    path.write_text(text)
    os.chmod(path, 0o600)
    assert last_tick(str(tmp_path), "toy").startswith("last tick record unreadable")
    assert last_tick(str(tmp_path / "none"), "toy") == "no tick yet"


def drift_overrides(tmp: Path, uri: str) -> list[str]:
    return [*toy_overrides(tmp, uri, "trust"), "serve.endpoints=[http://127.0.0.1:9]", "serve.allow_http=true",
            "serve.num_speculative_tokens=3", f"serve.state_dir={tmp / 'watch'}", "schedule.trigger=drift"]


@pytest.mark.parametrize("store", ["missing", "empty", "foreign-sqlite", "not-sqlite"])
def test_watch_and_a_drift_tick_never_create_or_write_the_store(tmp_path, store):
    import sqlite3

    db = tmp_path / "store" / "mlflow.db"
    db.parent.mkdir()
    if store == "empty":
        db.touch()
    elif store == "foreign-sqlite":
        with sqlite3.connect(db) as con:
            con.execute("CREATE TABLE notes (x)")
    elif store == "not-sqlite":
        db.write_text("a notebook, not a database\n")
    before = db.read_bytes() if db.exists() else None
    ov = drift_overrides(tmp_path, f"sqlite:///{db}")
    with pytest.raises(UserError, match="check --tracking-uri or tracking.uri") as err:
        retrain.watch(CONFIG, ov)
    assert "\n" not in str(err.value)
    # The scheduled drift tick says the same in its record, and exits non-zero.
    assert retrain.retrain_tick(CONFIG, ov, now=1.8e9) == 1
    assert "watch: " in last_tick(str(tmp_path / "slurm" / "schedule"), "trust")
    assert (db.read_bytes() if db.exists() else None) == before  # nothing created, nothing written
    assert not (tmp_path / "watch").exists()
