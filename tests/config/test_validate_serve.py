"""The serving watch's bad input: one line at `validate`, naming the key; credentials never
echoed. The champion check (it needs the registry) is in tests/launch/test_retrain_drift.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.config.test_bad_input import problems_for
from tests.fixtures.recipes import resolve_recipe

ROOT = Path(__file__).resolve().parents[2]
KIMI = ROOT / "configs" / "kimi-k2.6-dspark.yaml"
GOOD = ["serve.endpoints=[https://serve-0.example:8000, 'http://10.0.0.7:8000/']"]

BAD = {
    "not a URL": (["serve.endpoints=[serve-0:8000]"], "serve.endpoints[0] = 'serve-0:8000': not an http(s) URL"),
    "no host": (["serve.endpoints=['http:///metrics']"], "serve.endpoints[0]"),
    "bad port": (["serve.endpoints=['http://h:99999']"], "not a URL"),
    "credentials in the URL": (["serve.endpoints=['https://bob:hunter2@h:8000']"], "carries credentials"),
    "a query": (["serve.endpoints=['https://h:8000/?token=x']"], "has a query"),
    "twice": (["serve.endpoints=[https://h:1, https://h:1]"], "lists an endpoint twice"),
    "ratio zero": (["serve.drift_ratio=0"], "serve.drift_ratio = 0.0: must be in (0, 1]"),
    "ratio above one": (["serve.drift_ratio=1.2"], "serve.drift_ratio = 1.2: must be in (0, 1]"),
    "window zero": (["serve.window=0"], "serve.window = 0: must be >= 1"),
    "negative min drafts": (["serve.min_drafts=-1"], "serve.min_drafts"),
    "cooldown not a duration": (["serve.cooldown=a day"], "serve.cooldown = 'a day': not a duration"),
    "token itself in token_env": (["serve.token_env=hf_abcdefghijklmnopqrstuv"],
                                  "serve.token_env = '***': must name an environment variable"),
    "two token sources": (["serve.token_env=T", "serve.token_file=/x"], "serve.token_file is set too"),
    "token over plain http": (["serve.endpoints=['http://h:8000']", "serve.token_env=T"], "serve.allow_http=true"),
    "drift without endpoints": (["schedule.trigger=drift", "serve.endpoints=[]"],
                                "schedule.trigger = 'drift': drift needs the servers"),
    "both without endpoints": (["schedule.trigger=both", "serve.endpoints=[]"], "schedule.trigger = 'both'"),
    "unknown trigger": (["schedule.trigger=weekly"], "must be one of cron, drift, both"),
    "zero served n": (["serve.num_speculative_tokens=0"], "serve.num_speculative_tokens"),
}


@pytest.mark.parametrize("overrides,needle", list(BAD.values()), ids=list(BAD))
def test_bad_serve_value_is_one_line_naming_the_key(overrides, needle):
    problems = problems_for([*GOOD, *overrides])
    assert any(needle in p for p in problems), problems
    assert not any("hunter2" in p or "hf_abcdefghijklmnopqrstuv" in p for p in problems), problems


def test_a_drift_schedule_with_endpoints_validates():
    cfg = resolve_recipe(KIMI, [*GOOD, "schedule.trigger=both", "serve.token_env=DSPARK_SERVE_TOKEN",
                                "serve.allow_http=true", "serve.cooldown=6:00:00"])
    assert cfg.schedule.trigger.value == "both" and cfg.serve.endpoints[1] == "http://10.0.0.7:8000/"
