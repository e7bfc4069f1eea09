"""The toy's calibration set: benchmark rows no evaluation reads, and traffic training never saw."""

from __future__ import annotations

import json

from hpc.config import load_config, to_object
from hpc_dev.toy_data import calibration_overrides, toy_traffic, write_toy_conversations

CONFIG = "configs/toy-cpu.yaml"


def questions(path) -> list[str]:
    return [t["value"] for line in path.read_text().splitlines()
            for t in json.loads(line)["conversations"] if t["from"] == "human"]


def test_traffic_asks_no_training_question_and_each_once():
    trained = {"What does os.getcwd do?"}
    rows = toy_traffic(400, seed=2, exclude=trained)
    asked = [r["conversations"][0]["value"] for r in rows]
    assert len(rows) == 400 and len(set(asked)) == 400 and not trained & set(asked)
    assert all(len(r["conversations"]) == 2 and r["source"] == "toy-traffic" for r in rows)
    everything = toy_traffic(10**6, seed=2, exclude=set())
    assert len(everything) < 10**6  # the corpus runs out: every question once, no repeats to pad it
    assert set(asked) <= {r["conversations"][0]["value"] for r in everything}


def test_calibration_overrides_add_traffic_that_training_never_asks(tmp_path):
    data = write_toy_conversations(tmp_path / "train.jsonl", n=200, seed=1)
    user = [f"data.sources=[{{path: {data}}}]"]
    plain = calibration_overrides(CONFIG, tmp_path / "a", user)
    with_traffic = calibration_overrides(CONFIG, tmp_path / "b", user, traffic=50)
    cfg = to_object(load_config(CONFIG, [*with_traffic, *user]))
    paths = [s.path for s in cfg.data.calibration_sources]
    assert [p.rsplit("/", 1)[1] for p in paths] == ["calibration.jsonl", "traffic.jsonl"]
    assert len(to_object(load_config(CONFIG, [*plain, *user])).data.calibration_sources) == 1
    from pathlib import Path

    traffic = questions(Path(paths[1]))
    assert len(traffic) == 50 and not set(traffic) & set(questions(data))
    assert cfg.train.hold_out_every == 0
