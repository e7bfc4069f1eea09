"""One watch tick: read the endpoints, pool the deltas, judge them against the champion's
evaluated tau, log the point. Whether a fired tick submits is the launcher's business
(hpc/launch/watch_cli.py): this package never submits.

The state between ticks is one owner-only JSON file per config name under serve.state_dir,
written atomically: a tick killed halfway leaves the last tick's state, not half of this one.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from hpc.errors import UserError
from hpc.formats.slurm_time import parse_slurm_time
from hpc.fsio import read_trusted, write_text
from hpc.watch.drift import Reading, Rule, Verdict, WatchState, judge, pool
from hpc.watch.evaluated import Evaluated, champion_at
from hpc.watch.scrape import check_transport, read_token, scrape
from hpc.watch.serving_run import log_tick, serving_run


def state_path(cfg) -> Path:
    return Path(cfg.serve.state_dir) / f"{cfg.name}.watch.json"


def load_state(path: Path) -> WatchState:
    """The last tick's state. It decides whether a drift fires a retrain (its streak and cooldown),
    so only a file of ours that nobody else may write, and no link, is read."""
    if not os.path.lexists(path):
        return WatchState()
    try:
        text = read_trusted(path)
    except PermissionError as err:
        raise UserError(f"{path}: not trusted ({err}); serve.state_dir must be a directory of yours "
                        "(chmod 700); delete the file to start the watch over") from None
    except OSError as err:
        raise UserError(f"{path}: cannot be read ({err.strerror}); delete it to start the watch over") from None
    try:
        return WatchState.from_json(json.loads(text))
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        raise UserError(f"{path}: not a watch state ({err}); delete it to start the watch over") from None


def save_state(path: Path, state: WatchState) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_text(path, json.dumps(state.to_json(), indent=1), mode=0o600)


def served_n(cfg) -> int:
    return cfg.serve.num_speculative_tokens or max(cfg.eval.num_speculative_tokens)


def rule(cfg) -> Rule:
    s = cfg.serve
    return Rule(s.drift_ratio, s.window, s.min_drafts, 60.0 * (parse_slurm_time(s.cooldown) or 0))


@dataclass
class TickResult:
    verdict: Verdict
    readings: list[Reading]
    notes: list[str] = field(default_factory=list)
    evaluated: Evaluated | None = None

    def lines(self) -> list[str]:
        return [*self.notes, self.verdict.line]


def watch_tick(cfg, client, state: WatchState, now: float | None = None, plot_dir: Path | None = None) -> TickResult:
    """One tick on `state` (updated in place; the caller saves it once it has acted on a fire)."""
    s = cfg.serve
    token = read_token(s.token_env, s.token_file)
    check_transport(s.endpoints, token, s.allow_http)
    now = time.time() if now is None else now
    readings = scrape(s.endpoints, token, s.timeout_s)
    delta, notes = pool(state, readings)
    answered = sum(r.counters is not None for r in readings)
    if not answered:
        return TickResult(Verdict(f"none of the {len(readings)} endpoint(s) answered; nothing to judge"),
                          readings, notes)
    ev = champion_at(client, cfg.tracking.registered_model, served_n(cfg))
    served = delta.drafted_tokens / delta.verify_steps if delta.verify_steps else None
    if served is not None and abs(served - ev.n) > 1e-9:
        notes.append(f"the endpoints drafted {served:.2f} tokens per draft, not serve.num_speculative_tokens="
                     f"{ev.n}: set it to the n they serve (or they verify adaptively)")
    verdict = judge(state, delta, now=now, champion=ev.version, eval_tau=ev.tau, rule=rule(cfg))
    run_id = serving_run(client, ev, s.endpoints)
    log_tick(client, run_id, ev, verdict, state.ticks, answered, s.drift_ratio, plot_dir)
    return TickResult(verdict, readings, notes, ev)
