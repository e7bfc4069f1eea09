"""Traffic as data (`kind: traffic`): the window, one copy per conversation, the turns alone,
and the window pinned at submission so every stage of a pipeline reads the same rows."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from hpc.config.schema import DataSource, SourceKind
from hpc.data.reader import read_source
from hpc.data.traffic import traffic_rows
from hpc.errors import UserError
from tests.config.test_bad_input import problems_for
from tests.fixtures.recipes import resolve_recipe

ROOT = Path(__file__).resolve().parents[2]
KIMI = ROOT / "configs" / "kimi-k2.6-dspark.yaml"
NOW = 1_800_000_000.0  # 2027-01-15T08:00:00Z
DAY = 86400.0


def chat(q: str, a: str = "ok") -> list[dict]:
    return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]


def write_log(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_the_window_each_conversation_once_and_nothing_but_the_turns(tmp_path):
    log = write_log(tmp_path / "served.jsonl", [
        {"timestamp": NOW - 9 * DAY, "messages": chat("too old")},
        {"timestamp": NOW - 2 * DAY, "messages": chat("fresh"), "user_id": "u-17", "request_id": "r1"},
        {"timestamp": "2027-01-14T08:00:00Z", "messages": chat("fresh")},  # a copy: counted once
        {"timestamp": "2027-01-15T07:00:00", "conversations": [{"from": "human", "value": "naive is UTC"},
                                                               {"from": "gpt", "value": "yes"}]},
        {"timestamp": NOW + DAY, "messages": chat("after the window's end")},
        {"messages": chat("no timestamp")},
        {"timestamp": NOW - DAY, "messages": [{"role": "robot", "content": "x"}]},
    ])
    skipped: Counter = Counter()
    rows = list(traffic_rows(str(log), 7.0, "2027-01-15T08:00:00Z", skipped=skipped))
    assert rows == [{"messages": chat("fresh")}, {"messages": chat("naive is UTC", "yes")}]  # no user or request id
    assert skipped == Counter(outside_window=2, duplicate=1, no_timestamp=1, not_a_chat=1)
    # Without an end the window ends now; a directory reads its files in name order; max_rows caps the yield.
    write_log(tmp_path / "b.jsonl", [{"timestamp": NOW - 1, "messages": chat("second file")}])
    rows = list(traffic_rows(str(tmp_path), 30.0, None, now=NOW))
    assert [r["messages"][0]["content"] for r in rows] == ["second file", "too old", "fresh", "naive is UTC"]
    assert len(list(traffic_rows(str(tmp_path), 30.0, None, max_rows=2, now=NOW))) == 2


def test_read_source_dispatches_by_kind_and_bad_windows_are_one_line(tmp_path):
    log = write_log(tmp_path / "served.jsonl", [{"timestamp": NOW, "messages": chat("hi")},
                                                 {"timestamp": NOW, "messages": chat("hi")}])
    as_rows = list(read_source(DataSource(str(log))))
    as_traffic = list(read_source(DataSource(str(log), kind=SourceKind.traffic, until="2027-01-15T08:00:00Z")))
    assert len(as_rows) == 2 and len(as_traffic) == 1
    with pytest.raises(UserError, match="until = 'yesterday': not a time"):
        list(traffic_rows(str(log), 7.0, "yesterday"))
    with pytest.raises(UserError, match="no such traffic log"):
        list(traffic_rows(str(tmp_path / "none.jsonl"), 7.0, None))
    # Which rows a traffic source reads is part of the data's identity; a rows source's is unchanged.
    assert DataSource(str(log)).settings() == [str(log), "train", None]
    assert DataSource(str(log), kind=SourceKind.traffic, until="x").settings() == [str(log), "train", None,
                                                                                  "traffic", 7.0, "x"]


def test_traffic_sources_validate_and_submission_pins_their_window(tmp_path):
    from hpc.launch.submit import traffic_pins

    log = write_log(tmp_path / "served.jsonl", [{"timestamp": NOW, "messages": chat("hi")}])
    src = f"{{path: {log}, kind: traffic, max_age_days: 3}}"
    cfg = resolve_recipe(KIMI, [f"data.sources=[{src}]", f"data.calibration_sources=[{src}]"])
    pins = traffic_pins(cfg, now=NOW)
    assert pins == ["data.sources.0.until='2027-01-15T08:00:00Z'", "data.calibration_sources.0.until='2027-01-15T08:00:00Z'"]
    pinned = resolve_recipe(KIMI, [f"data.sources=[{src}]", pins[0]])
    assert pinned.data.sources[0].until == "2027-01-15T08:00:00Z" and traffic_pins(pinned) == []
    bad = {f"{{path: {tmp_path / 'nope.jsonl'}, kind: traffic}}": "data.sources[0].path",
           f"{{path: {log}, kind: traffic, max_age_days: 0}}": "data.sources[0].max_age_days = 0.0: must be > 0",
           f"{{path: {log}, kind: traffic, until: soon}}": "data.sources[0].until = 'soon': not a time",
           f"{{path: {log}, kind: logs}}": "must be one of rows, traffic"}
    for source, needle in bad.items():
        problems = problems_for([f"data.sources=[{source}]"])
        assert any(needle in p for p in problems), problems
