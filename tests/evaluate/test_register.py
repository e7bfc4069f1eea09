"""After an evaluation, the draft is registered; the champion moves only when the config lets it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hpc.evaluate import runner
from hpc.track import registry


@pytest.fixture
def calls(monkeypatch):
    seen: list[str] = []
    monkeypatch.setattr(runner, "load_results", lambda _: [
        SimpleNamespace(benchmark="gsm8k", sha256="a" * 64, accept_len=3.0),
        SimpleNamespace(benchmark="aime", sha256="b" * 64, accept_len=None),
    ])
    monkeypatch.setattr(registry, "register_draft", lambda *a: seen.append("register") or "4")
    monkeypatch.setattr(registry, "promote_if_better",
                        lambda *a: seen.append("promote") or (True, "champion moves v3 -> v4"))
    return seen


META = {"registered_model": "m", "n": 7}


def test_registration_promotes_a_better_draft_by_default(calls, capsys):
    runner._register(object(), None, META, "run")
    assert calls == ["register", "promote"]
    assert "m v4 (mean acceptance length 3.000 at n=7); champion moves v3 -> v4" in capsys.readouterr().out


def test_promote_if_better_false_registers_without_touching_the_champion(calls, capsys):
    runner._register(object(), None, META, "run", promote=False)
    assert calls == ["register"]
    assert "champion left as it is (schedule.promote_if_better is false)" in capsys.readouterr().out
