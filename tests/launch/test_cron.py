"""The cron parser behind `dspark schedule`: next firing times, and one-line errors naming schedule.cron."""

from __future__ import annotations

import datetime
import re

import pytest

from hpc.errors import UserError
from hpc.launch import schedule
from hpc.launch.cron import next_run, parse_cron

D = datetime.datetime

# 2026-11-29 is a Sunday.
NEXT_RUN = [
    ("0 3 * * 0", D(2026, 11, 29, 2, 59), D(2026, 11, 29, 3, 0)),
    ("0 3 * * 0", D(2026, 11, 29, 3, 0), D(2026, 12, 6, 3, 0)),  # strictly after
    ("0 3 * * 7", D(2026, 11, 29, 22, 19, 5), D(2026, 12, 6, 3, 0)),  # 7 is Sunday too
    ("*/15 * * * *", D(2026, 1, 1, 10, 7, 30), D(2026, 1, 1, 10, 15)),
    ("*/15 * * * *", D(2026, 1, 1, 10, 59), D(2026, 1, 1, 11, 0)),
    ("5/20 * * * *", D(2026, 1, 1, 10, 6), D(2026, 1, 1, 10, 25)),
    ("5,35 * * * *", D(2026, 1, 1, 12, 5), D(2026, 1, 1, 12, 35)),
    ("30 8-10/2 * * mon-fri", D(2026, 11, 28, 12, 0), D(2026, 11, 30, 8, 30)),
    ("30 8-10/2 * * 1-5", D(2026, 11, 30, 8, 30), D(2026, 11, 30, 10, 30)),
    ("0 0 1 1 *", D(2026, 6, 1), D(2027, 1, 1)),
    ("0 0 1 jan,jul *", D(2026, 2, 1), D(2026, 7, 1)),
    ("59 23 31 12 *", D(2026, 12, 31, 23, 59), D(2027, 12, 31, 23, 59)),
    ("0 0 29 2 *", D(2026, 3, 1), D(2028, 2, 29)),
    ("0 0 31 * *", D(2026, 4, 1), D(2026, 5, 31)),  # April has no 31st
    # Both day fields restricted: the 15th OR a Friday, as cron does.
    ("0 12 15 * 5", D(2026, 11, 30, 13, 0), D(2026, 12, 4, 12, 0)),
    ("0 12 15 * 5", D(2026, 12, 12, 0, 0), D(2026, 12, 15, 12, 0)),
    ("0 0 13 * fri", D(2026, 1, 1), D(2026, 1, 2)),  # not "Friday the 13th": a Friday will do
    ("0 0 * 2 fri", D(2026, 1, 1), D(2026, 2, 6)),  # day of month `*`: only the weekday counts
]


@pytest.mark.parametrize("cron, after, expected", NEXT_RUN)
def test_next_run(cron, after, expected):
    assert next_run(cron, after) == expected


@pytest.mark.parametrize("cron, why", [
    ("0 3 * *", "has 4 field(s), not 5"),
    ("60 * * * *", "minute: '60' is outside 0-59"),
    ("*/0 * * * *", "minute: step '0' must be >= 1"),
    ("0 3 * * sunday", "day of week: 'sunday' is not a number"),
    ("0 0 5-1 * *", "day of month: '5-1' is an empty range"),
    ("0 0 0 * *", "day of month: '0' is outside 1-31"),
])
def test_bad_cron(cron, why):
    with pytest.raises(ValueError, match=f"^{re.escape(why)}$"):
        parse_cron(cron)
    with pytest.raises(UserError, match=r"^schedule.cron = .*; use 5 fields"):
        schedule.check_cron(cron)


def test_never_firing_cron():
    with pytest.raises(ValueError, match="never fires"):
        next_run("0 0 30 2 *", D(2026, 1, 1))


def test_missing_cron_names_the_key_and_the_flag():
    with pytest.raises(UserError, match=r"^schedule.cron is not set: pass --cron"):
        schedule.check_cron(None)
