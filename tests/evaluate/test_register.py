"""After an evaluation, the draft is registered; the champion moves only when the config lets it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from hpc.evaluate import record


@pytest.fixture
def calls(monkeypatch):
    seen: list[str] = []
    monkeypatch.setattr(record, "load_results", lambda _: [
        SimpleNamespace(benchmark="gsm8k", sha256="a" * 64, accept_len=3.0),
        SimpleNamespace(benchmark="aime", sha256="b" * 64, accept_len=None),
    ])
    monkeypatch.setattr(record, "register_draft", lambda *a, n: seen.append(f"register at n={n}") or "4")
    monkeypatch.setattr(record, "promote_if_better",
                        lambda *a: seen.append("promote") or (True, "champion moves v3 -> v4"))
    return seen


META = {"registered_model": "m", "n": 7, "name": "eval-n7-DSpark"}
CLIENT = SimpleNamespace(search_model_versions=lambda _filter: [])  # no version of this run yet


@pytest.fixture
def run_dir(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps(META))
    return tmp_path


def registered(run_dir):
    return json.loads((run_dir / "run.json").read_text()).get("registered", "never marked")


def test_registration_promotes_a_better_draft_by_default(calls, capsys, run_dir):
    record._register(CLIENT, run_dir, META, "run")
    assert calls == ["register at n=7", "promote"] and registered(run_dir) == "4"
    assert "m v4 (mean acceptance length 3.000 at n=7); champion moves v3 -> v4" in capsys.readouterr().out


def test_promote_if_better_false_registers_without_touching_the_champion(calls, capsys, run_dir):
    record._register(CLIENT, run_dir, META, "run", promote=False)
    assert calls == ["register at n=7"] and registered(run_dir) == "4"
    assert "champion left as it is (schedule.promote_if_better is false)" in capsys.readouterr().out


def test_a_run_without_acceptance_counters_is_not_registered(calls, monkeypatch, capsys, run_dir):
    # vLLM builds without spec-decode metrics leave accept_len None on every benchmark.
    monkeypatch.setattr(record, "load_results", lambda _: [SimpleNamespace(benchmark="gsm8k", sha256="a" * 64,
                                                                           accept_len=None)])
    record._register(CLIENT, run_dir, META, "run")
    assert calls == [] and registered(run_dir) is None  # done: a retry has nothing to register
    assert "eval-n7-DSpark not registered: no benchmark has an acceptance length" in capsys.readouterr().out
