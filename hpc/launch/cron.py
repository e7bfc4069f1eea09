"""A 5-field cron expression (minute hour day-of-month month day-of-week) and its next firing.

Fields take `*`, numbers, lists (`1,15`), ranges (`1-5`), steps (`*/15`, `0-30/10`, `5/20`) and
month/weekday names (`jan`, `sun`); weekday 0 and 7 are both Sunday. As in Vixie cron (and
scrontab), when both day fields are restricted a day matches if EITHER does.

The check is ours, for its one-line errors naming the field; the firing times are croniter's,
in this host's time zone (the one the Slurm controller reads `--begin` in), so daylight-saving
changes are handled: a time the spring change skips fires at the change (02:30 -> 03:00), and
the hour the autumn change repeats fires in its first pass only. `--begin` takes a wall time,
and the second pass's wall times are the first pass's too: Slurm would start such a job at once.
"""

from __future__ import annotations

import datetime
import os
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter
from croniter.croniter import CroniterBadDateError

MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
DAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
# (name, low, high, names starting at `low`)
FIELDS = (("minute", 0, 59, ()), ("hour", 0, 23, ()), ("day of month", 1, 31, ()),
          ("month", 1, 12, MONTHS), ("day of week", 0, 7, DAYS))
HINT = "5 fields: minute hour day-of-month month day-of-week, e.g. '0 3 * * 0' (Sundays 03:00)"


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


# The longest each month gets (29 February fires in leap years).
MONTH_DAYS = (31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)


def parse_cron(expr: str) -> None:
    """Check `expr`; ValueError says which field is wrong, or that it never fires."""
    parts = expr.split()
    if len(parts) != 5:
        raise ValueError(f"has {len(parts)} field(s), not 5")
    values = []
    for text, (name, low, high, names) in zip(parts, FIELDS):
        try:
            values.append(_field(text, name, low, high, names))
        except ValueError as err:
            msg = str(err)
            raise ValueError(msg if msg.startswith(name) else f"{name}: {msg}") from None
    # croniter reads a weekday range or step from 7 as every day; Vixie cron reads 7 as Sunday.
    if any(("-" in p or "/" in p) and p.split("-")[0].split("/")[0].lower() == "7" for p in parts[4].split(",")):
        raise ValueError(f"day of week: {parts[4]!r}: write Sunday as 0 in a range or step (0-6, 0/2)")
    days, months = values[2], values[3]
    # Refused even with a weekday beside it: cron would then fire on that weekday, croniter (the
    # fallback schedule's clock) never.
    if not any(d <= MONTH_DAYS[m - 1] for m in months for d in days):
        raise ValueError(f"never fires: no month of {parts[3]!r} has day {parts[2]!r}; pick a day that exists")


def local_zone() -> datetime.tzinfo:
    """This host's zone with its daylight-saving rules (a fixed UTC offset would have none)."""
    name = os.environ.get("TZ", "").lstrip(":")
    try:
        if name:
            return ZoneInfo(name)
        with open("/etc/localtime", "rb") as f:
            return ZoneInfo.from_file(f, key="localtime")
    except (OSError, ValueError, ZoneInfoNotFoundError):
        return datetime.UTC


def next_run(cron: str, after: datetime.datetime) -> datetime.datetime:
    """The first time strictly after `after` (to the minute) at which `cron` fires. A naive
    `after` is this host's wall time, and so is the answer: what `sbatch --begin` reads."""
    # Here, not at the top: `dspark validate` checks schedule.cron with parse_cron alone.

    parse_cron(cron)
    start = after if after.tzinfo else after.replace(tzinfo=local_zone())
    times = croniter(cron, start.replace(second=0, microsecond=0))
    try:
        t = times.get_next(datetime.datetime)
        while t.fold:  # the repeated hour's second pass
            t = times.get_next(datetime.datetime)
    except CroniterBadDateError:
        raise ValueError("never fires (e.g. 30 February); pick a day that exists") from None
    return t if after.tzinfo else t.replace(tzinfo=None)
