"""Traffic as data: the prompts a serving stack logged, so a retrain learns what it is asked now.

A `data.sources` entry with `kind: traffic` names a JSONL file (or a directory of them) that the
serving stack wrote: one chat row per line, as `messages` or `conversations`, with a `timestamp`
(unix seconds, or ISO 8601; naive times are UTC). Only rows inside the window
[until - max_age_days, until] are read, and each conversation once: the first of its copies, by
the sha256 of its turns. Nothing else of a logged line leaves this module: the rows it yields
hold the turns alone, not the user ids, request ids or headers a log line may also carry.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from hpc.data.sources import _jsonl_rows, to_messages
from hpc.errors import UserError
from hpc.formats.slurm_time import parse_time

DAY_S = 86400.0


def window_end(until: str | None, now: float) -> float:
    if until is None:
        return now
    end = parse_time(until)
    if end is None:
        raise UserError(f"data.sources[].until = {until!r}: not a time; use ISO 8601, e.g. 2026-12-05T03:00:00Z")
    return end


def content_key(messages: list[dict]) -> str:
    canon = json.dumps([[m["role"], m["content"]] for m in messages], ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()


def traffic_rows(path: str, max_age_days: float, until: str | None, max_rows: int | None = None,
                 now: float | None = None, skipped: Counter | None = None) -> Iterator[dict]:
    """The window's conversations, each once, in log order, as {"messages": [...]}; `skipped`
    counts what was left out and why (outside the window, a copy, no timestamp, not a chat)."""
    p = Path(path).expanduser()
    files = sorted(p.glob("*.jsonl")) if p.is_dir() else [p]
    if not p.exists():
        raise UserError(f"data.sources[].path = {path}: no such traffic log; point it at the JSONL file (or "
                        "directory of them) the serving stack writes")
    end = window_end(until, time.time() if now is None else now)
    start = end - max_age_days * DAY_S
    skipped = Counter() if skipped is None else skipped
    seen: set[str] = set()
    for f in files:
        for row in _jsonl_rows(f):
            ts = parse_time(row.get("timestamp"))
            if ts is None:
                skipped["no_timestamp"] += 1
                continue
            if not start <= ts <= end:
                skipped["outside_window"] += 1
                continue
            try:
                msgs = to_messages(row)
            except (ValueError, KeyError, TypeError):
                skipped["not_a_chat"] += 1
                continue
            key = content_key(msgs)
            if key in seen:
                skipped["duplicate"] += 1
                continue
            seen.add(key)
            yield {"messages": msgs}
            if max_rows is not None and len(seen) >= max_rows:
                return
