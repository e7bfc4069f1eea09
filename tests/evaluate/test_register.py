"""After an evaluation, the draft is registered; the champion moves only when the config lets it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hpc.evaluate import record
from hpc.track import registry


@pytest.fixture
def calls(monkeypatch):
    seen: list[str] = []
    monkeypatch.setattr(record, "load_results", lambda _: [
        SimpleNamespace(benchmark="gsm8k", sha256="a" * 64, accept_len=3.0),
        SimpleNamespace(benchmark="aime", sha256="b" * 64, accept_len=None),
    ])
    monkeypatch.setattr(registry, "register_draft", lambda *a, n: seen.append(f"register at n={n}") or "4")
    monkeypatch.setattr(registry, "promote_if_better",
                        lambda *a: seen.append("promote") or (True, "champion moves v3 -> v4"))
    return seen


META = {"registered_model": "m", "n": 7, "name": "eval-n7-DSpark"}


def test_registration_promotes_a_better_draft_by_default(calls, capsys):
    record._register(object(), None, META, "run")
    assert calls == ["register at n=7", "promote"]
    assert "m v4 (mean acceptance length 3.000 at n=7); champion moves v3 -> v4" in capsys.readouterr().out


def test_promote_if_better_false_registers_without_touching_the_champion(calls, capsys):
    record._register(object(), None, META, "run", promote=False)
    assert calls == ["register at n=7"]
    assert "champion left as it is (schedule.promote_if_better is false)" in capsys.readouterr().out


def test_a_run_without_acceptance_counters_is_not_registered(calls, monkeypatch, capsys):
    # vLLM builds without spec-decode metrics leave accept_len None on every benchmark.
    monkeypatch.setattr(record, "load_results", lambda _: [SimpleNamespace(benchmark="gsm8k", sha256="a" * 64,
                                                                           accept_len=None)])
    record._register(object(), None, META, "run")
    assert calls == []
    assert "eval-n7-DSpark not registered: no benchmark has an acceptance length" in capsys.readouterr().out
