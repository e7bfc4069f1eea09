"""The drift rule on counter reads: deltas, resets, silent endpoints, the window, the traffic
floor and the cooldown. Pure logic: the ticks against real servers are in test_watch_vllm.py."""

from __future__ import annotations

import json

import pytest

from hpc.evaluate.engines import Counters
from hpc.watch.drift import Reading, Rule, WatchState, judge, pool

RULE = Rule(ratio=0.9, window=3, min_drafts=100, cooldown_s=3600.0)
EVAL_TAU = 3.0  # the line is 2.7


def read(url: str, drafts: int, accepted: int, n: int = 3, started: float | None = 1.0) -> Reading:
    per_pos = [accepted // n] * n
    per_pos[0] += accepted - sum(per_pos)
    return Reading(url, Counters(drafts, n * drafts, accepted, per_pos), started)


class Served:
    """Cumulative counters of endpoints as vLLM keeps them, advanced by traffic of a given tau."""

    def __init__(self, *urls: str):
        self.totals = {u: [0, 0] for u in urls}

    def traffic(self, url: str, drafts: int, tau: float) -> None:
        self.totals[url][0] += drafts
        self.totals[url][1] += round(drafts * (tau - 1))

    def readings(self) -> list[Reading]:
        return [read(u, d, a) for u, (d, a) in self.totals.items()]


def tick(state: WatchState, readings: list[Reading], now: float, champion: str = "1"):
    delta, notes = pool(state, readings)
    return judge(state, delta, now=now, champion=champion, eval_tau=EVAL_TAU, rule=RULE), notes


def test_deltas_pool_over_endpoints_and_fire_after_the_window():
    s, state = Served("http://a", "http://b"), WatchState()
    v, notes = tick(state, s.readings(), 0)
    assert v.tick is None and len(notes) == 2 and all("first read" in n for n in notes)
    lines = []
    for t in range(1, 4):
        s.traffic("http://a", 40, 2.0)
        s.traffic("http://b", 10, 2.5)
        v, notes = tick(state, s.readings(), 600.0 * t)
        assert not notes and v.tick.drafts == 50
        assert v.tick.live_tau == pytest.approx(1 + (40 + 15) / 50)  # pooled, not averaged per endpoint
        lines.append(v)
    assert [x.fire for x in lines] == [False, False, True]
    assert "fires at 3" in lines[0].line and "drift; firing" in lines[2].line
    e = lines[2].evidence
    assert e["window"] == 3 and e["drafts"] == 150 and e["live_tau"] == pytest.approx(2.1) and e["since"] == 600.0
    assert state.streak == [] and state.last_fire == 1800.0  # the streak that fired is spent


def test_a_good_tick_breaks_the_streak_and_idle_ticks_neither_count_nor_break():
    s, state = Served("http://a"), WatchState()
    tick(state, s.readings(), 0)
    for t, tau in enumerate([2.0, 2.0, 2.9, 2.0, 2.0], start=1):
        s.traffic("http://a", 60, tau)
        v, _ = tick(state, s.readings(), t)
        assert not v.fire
    assert len(state.streak) == 2  # the 2.9 tick (above 2.7) reset it
    v, _ = tick(state, s.readings(), 10)  # no traffic since the last tick
    assert v.tick is None and "no drafts" in v.line and len(state.streak) == 2
    s.traffic("http://a", 60, 2.0)
    v, _ = tick(state, s.readings(), 11)
    assert v.fire


def test_too_little_traffic_never_fires():
    s, state = Served("http://a"), WatchState()
    tick(state, s.readings(), 0)
    for t in range(1, 6):
        s.traffic("http://a", 15, 1.0)  # 5 ticks x 15 drafts < min_drafts 100
        v, _ = tick(state, s.readings(), t)
        assert not v.fire
    assert "only 75 drafts seen" in v.line and "serve.min_drafts=100" in v.line
    s.traffic("http://a", 30, 1.0)
    assert tick(state, s.readings(), 6)[0].fire


def test_a_restarted_server_is_a_new_base_not_a_collapse():
    state = WatchState()
    tick(state, [read("http://a", 1000, 2000)], 0)
    tick(state, [read("http://a", 1100, 2200)], 1)
    # Restarted: the counters start over, and read lower than before.
    v, notes = tick(state, [read("http://a", 10, 5, started=2.0)], 2)
    assert v.tick is None and notes == ["http://a: counters reset (the server restarted); counting from now"]
    v, _ = tick(state, [read("http://a", 110, 205, started=2.0)], 3)
    assert v.tick.drafts == 100 and v.tick.live_tau == pytest.approx(3.0)
    # A restart that served more than before by the next tick: only the start time tells.
    v, notes = tick(state, [read("http://a", 5000, 15000, started=3.0)], 4)
    assert v.tick is None and "restarted" in notes[0]
    # A server that exports no start time: counters going backwards still tell.
    state = WatchState()
    tick(state, [read("http://a", 100, 200, started=None)], 0)
    v, notes = tick(state, [read("http://a", 50, 20, started=None)], 1)
    assert v.tick is None and "restarted" in notes[0]


def test_a_silent_endpoint_keeps_its_base_and_the_others_are_judged():
    state = WatchState()
    tick(state, [read("http://a", 100, 200), read("http://b", 100, 200)], 0)
    v, notes = tick(state, [read("http://a", 200, 400), Reading("http://b", None, error="ConnectTimeout")], 1)
    assert notes == ["http://b: no answer (ConnectTimeout); left out of this tick"] and v.tick.drafts == 100
    # b answers again, unrestarted: its delta covers both ticks, nothing lost.
    v, _ = tick(state, [read("http://a", 200, 400), read("http://b", 300, 600)], 2)
    assert v.tick.drafts == 200


def test_the_cooldown_holds_a_second_fire_and_a_new_champion_starts_over():
    s, state = Served("http://a"), WatchState()
    tick(state, s.readings(), 0)
    verdicts = []
    for t in range(1, 11):  # a tick every 10 minutes, all of them low; the cooldown is an hour
        s.traffic("http://a", 100, 1.5)
        verdicts.append(tick(state, s.readings(), 600.0 * t)[0])
    assert [t for t, v in enumerate(verdicts, start=1) if v.fire] == [3, 9]
    assert all("cooldown" in verdicts[t - 1].line for t in (6, 7, 8))  # a full window, within the hour
    assert "(fires at 3)" in verdicts[3].line  # after a fire the window fills afresh
    s.traffic("http://a", 100, 1.5)
    v, _ = tick(state, s.readings(), 6600, champion="2")  # the retrain became champion: judged afresh
    assert len(state.streak) == 1 and state.champion == "2" and not v.fire


def test_the_state_survives_its_file():
    s, state = Served("http://a"), WatchState()
    tick(state, s.readings(), 0)
    s.traffic("http://a", 100, 1.5)
    tick(state, s.readings(), 1)
    again = WatchState.from_json(json.loads(json.dumps(state.to_json())))
    assert again == state
    s.traffic("http://a", 100, 1.5)
    assert tick(again, s.readings(), 2)[0].tick.drafts == 100
