"""A 5-field cron expression (minute hour day-of-month month day-of-week) and its next firing.

Fields take `*`, numbers, lists (`1,15`), ranges (`1-5`), steps (`*/15`, `0-30/10`, `5/20`) and
month/weekday names (`jan`, `sun`); weekday 0 and 7 are both Sunday. As in Vixie cron (and
scrontab), when both day fields are restricted a day matches if EITHER does. Times are local,
as the Slurm controller reads `--begin` and scrontab lines.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
DAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
# (name, low, high, names starting at `low`)
FIELDS = (("minute", 0, 59, ()), ("hour", 0, 23, ()), ("day of month", 1, 31, ()),
          ("month", 1, 12, MONTHS), ("day of week", 0, 7, DAYS))
HINT = "5 fields: minute hour day-of-month month day-of-week, e.g. '0 3 * * 0' (Sundays 03:00)"


@dataclass(frozen=True)
class Cron:
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]  # 0 = Sunday, as datetime.isoweekday() % 7
    any_day: bool  # day-of-month was `*`
    any_weekday: bool

    def day_matches(self, d: datetime.date) -> bool:
        dom, dow = d.day in self.days, d.isoweekday() % 7 in self.weekdays
        if self.any_day or self.any_weekday:
            return dom and dow
        return dom or dow


def _value(text: str, low: int, names: tuple[str, ...]) -> int:
    if text.lower() in names:
        return low + names.index(text.lower())
    if not text.isdigit():
        raise ValueError(f"{text!r} is not a number")
    return int(text)


def _field(text: str, name: str, low: int, high: int, names: tuple[str, ...]) -> set[int]:
    out: set[int] = set()
    for part in text.split(","):
        rng, _, step_text = part.partition("/")
        step = _value(step_text, 0, ()) if step_text else 1
        if step < 1:
            raise ValueError(f"{name}: step {step_text!r} must be >= 1")
        if rng == "*":
            a, b = low, high
        elif "-" in rng:
            a_text, _, b_text = rng.partition("-")
            a, b = _value(a_text, low, names), _value(b_text, low, names)
        else:
            a = _value(rng, low, names)
            b = high if step_text else a  # `5/20` means 5, 25, 45, ...
        if not (low <= a <= high and low <= b <= high):
            raise ValueError(f"{name}: {part!r} is outside {low}-{high}")
        if a > b:
            raise ValueError(f"{name}: {rng!r} is an empty range")
        out.update(range(a, b + 1, step))
    return out


def parse_cron(expr: str) -> Cron:
    """Parse `expr`; ValueError says which field is wrong."""
    parts = expr.split()
    if len(parts) != 5:
        raise ValueError(f"has {len(parts)} field(s), not 5")
    sets = []
    for text, (name, low, high, names) in zip(parts, FIELDS):
        try:
            sets.append(_field(text, name, low, high, names))
        except ValueError as err:
            msg = str(err)
            raise ValueError(msg if msg.startswith(name) else f"{name}: {msg}") from None
    weekdays = {d % 7 for d in sets[4]}
    return Cron(*(frozenset(s) for s in sets[:4]), frozenset(weekdays), parts[2] == "*", parts[4] == "*")


def next_run(cron: str | Cron, after: datetime.datetime) -> datetime.datetime:
    """The first time strictly after `after` (to the minute) at which `cron` fires."""
    c = parse_cron(cron) if isinstance(cron, str) else cron
    t = after.replace(second=0, microsecond=0) + datetime.timedelta(minutes=1)
    limit = t + datetime.timedelta(days=366 * 9)  # Feb 29 can be 8 years away (2096 -> 2104)
    while t < limit:
        if t.month not in c.months or not c.day_matches(t.date()):
            t = (t + datetime.timedelta(days=1)).replace(hour=0, minute=0)
            continue
        if t.hour not in c.hours:
            t = (t + datetime.timedelta(hours=1)).replace(minute=0)
            continue
        if t.minute in c.minutes:
            return t
        t += datetime.timedelta(minutes=1)
    raise ValueError("never fires (e.g. 30 February); pick a day that exists")
