"""Has the served draft drifted? Counter reads in, a verdict out. No I/O here: the tick
(hpc/watch/tick.py) reads the endpoints and the registry, and keeps this state on disk.

vLLM's spec-decode counters are cumulative per server process. A tick's evidence is their
delta since the last tick, pooled over the endpoints. An endpoint that did not answer, or whose
counters went backwards (a restarted server counts from zero), gives no delta this tick: its
next read is the new base. So a tick never judges on missing data, and a restart never looks
like a collapse in acceptance.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from hpc.evaluate.engines import Counters


@dataclass
class Reading:
    """One endpoint's /metrics at this tick: counters, or why there are none."""

    url: str
    counters: Counters | None
    started: float | None = None  # process_start_time_seconds, where the server exports it
    error: str = ""


@dataclass
class Tick:
    """A judged tick: the pooled deltas of every endpoint that gave one."""

    at: float
    drafts: int
    accepted: int
    accepted_per_pos: list[int]

    @property
    def live_tau(self) -> float:
        return 1.0 + self.accepted / self.drafts


@dataclass
class WatchState:
    """What a tick carries to the next; serialised as JSON beside the schedule (tick.py)."""

    seen: dict[str, dict] = field(default_factory=dict)  # url -> {"counters": ..., "started": ...}
    streak: list[Tick] = field(default_factory=list)  # consecutive ticks below the line, oldest first
    champion: str | None = None  # the version the streak was measured against
    last_fire: float | None = None
    ticks: int = 0

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> WatchState:
        return cls(seen=d.get("seen", {}), streak=[Tick(**t) for t in d.get("streak", [])],
                   champion=d.get("champion"), last_fire=d.get("last_fire"), ticks=int(d.get("ticks", 0)))


def _counters(d: dict) -> Counters:
    return Counters(**d)


def _went_back(now: Counters, before: Counters) -> bool:
    n = max(len(now.accepted_per_pos), len(before.accepted_per_pos))
    pos = [(a, b) for a, b in zip(_pad(now.accepted_per_pos, n), _pad(before.accepted_per_pos, n))]
    return (now.verify_steps < before.verify_steps or now.drafted_tokens < before.drafted_tokens
            or now.accepted_tokens < before.accepted_tokens or any(a < b for a, b in pos))


def pool(state: WatchState, readings: list[Reading]) -> tuple[Counters, list[str]]:
    """The deltas since the last tick, summed over the endpoints that gave one, and one note per
    endpoint that did not. Updates `state.seen` to this tick's reads."""
    total, notes = Counters(), []
    for r in readings:
        before = state.seen.get(r.url)
        if r.counters is None:
            notes.append(f"{r.url}: no answer ({r.error}); left out of this tick")
            continue  # its last read stays the base: a server that comes back unrestarted loses nothing
        state.seen[r.url] = {"counters": asdict(r.counters), "started": r.started}
        if before is None:
            notes.append(f"{r.url}: first read; counting from now")
            continue
        old = _counters(before["counters"])
        restarted = r.started is not None and before.get("started") not in (None, r.started)
        if restarted or _went_back(r.counters, old):
            notes.append(f"{r.url}: counters reset (the server restarted); counting from now")
            continue
        d = r.counters.minus(old)
        total = Counters(total.verify_steps + d.verify_steps, total.drafted_tokens + d.drafted_tokens,
                         total.accepted_tokens + d.accepted_tokens,
                         _add(total.accepted_per_pos, d.accepted_per_pos))
    for url in set(state.seen) - {r.url for r in readings}:  # no longer configured
        del state.seen[url]
    return total, notes


def _pad(v: list[int], n: int) -> list[int]:
    return list(v) + [0] * (n - len(v))


def _add(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    return [x + y for x, y in zip(_pad(a, n), _pad(b, n))]


@dataclass(frozen=True)
class Rule:
    """serve.drift_ratio, serve.window, serve.min_drafts and serve.cooldown, in seconds."""

    ratio: float
    window: int
    min_drafts: int
    cooldown_s: float


@dataclass
class Verdict:
    line: str  # what the tick prints
    tick: Tick | None = None  # None: nothing to judge this tick
    fire: bool = False
    evidence: dict = field(default_factory=dict)  # for the retrain's parent run, when it fires
    streak: list[Tick] = field(default_factory=list)  # the ticks that fired it: put back if nothing is submitted


def judge(state: WatchState, delta: Counters, *, now: float, champion: str, eval_tau: float, rule: Rule) -> Verdict:
    """Judge one tick's pooled delta against the champion's evaluated tau; updates the streak."""
    state.ticks += 1
    if state.champion != champion:  # a new draft is served: the old one's streak says nothing about it
        state.streak, state.champion = [], champion
    if delta.verify_steps <= 0:
        return Verdict("no drafts since the last tick; nothing to judge")
    tick = Tick(now, delta.verify_steps, delta.accepted_tokens, list(delta.accepted_per_pos))
    line_tau = rule.ratio * eval_tau
    live = f"live tau {tick.live_tau:.3f} over {tick.drafts} drafts vs evaluated {eval_tau:.3f}"
    if tick.live_tau >= line_tau:
        state.streak = []
        return Verdict(f"{live}: above the drift line {line_tau:.3f}", tick)
    state.streak.append(tick)
    drafts = sum(t.drafts for t in state.streak)
    below = f"{live}: below the drift line {line_tau:.3f}, {len(state.streak)} tick(s) in a row"
    if len(state.streak) < rule.window:
        return Verdict(f"{below} (fires at {rule.window})", tick)
    if drafts < rule.min_drafts:
        return Verdict(f"{below}, but only {drafts} drafts seen (serve.min_drafts={rule.min_drafts})", tick)
    if state.last_fire is not None and now - state.last_fire < rule.cooldown_s:
        left = rule.cooldown_s - (now - state.last_fire)
        return Verdict(f"{below}: drift, but the last retrain fired {now - state.last_fire:.0f} s ago "
                       f"(serve.cooldown: {left:.0f} s left); not firing", tick)
    accepted = sum(t.accepted for t in state.streak)
    evidence = {"live_tau": 1.0 + accepted / drafts, "eval_tau": eval_tau, "ratio": rule.ratio,
                "window": len(state.streak), "drafts": drafts, "since": state.streak[0].at, "champion": champion}
    fired, state.streak, state.last_fire = state.streak, [], now
    return Verdict(f"{below}: drift; firing the retrain", tick, fire=True, evidence=evidence, streak=fired)
