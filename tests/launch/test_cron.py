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
    # Accepted field by field, these never fire: scrontab would hold them silently forever.
    ("0 3 31 4 *", "never fires: no month of '4' has day '31'; pick a day that exists"),
    ("0 3 30,31 feb */2", "never fires: no month of 'feb' has day '30,31'; pick a day that exists"),
    # croniter fires these every day; Vixie cron reads 7 as Sunday.
    ("0 3 * * 7-7", "day of week: '7-7': write Sunday as 0 in a range or step (0-6, 0/2)"),
    ("0 3 * * 1,7/1", "day of week: '1,7/1': write Sunday as 0 in a range or step (0-6, 0/2)"),
])
def test_bad_cron(cron, why):
    with pytest.raises(ValueError, match=f"^{re.escape(why)}$"):
        parse_cron(cron)
    with pytest.raises(UserError, match=r"^schedule.cron = .*; use 5 fields"):
        schedule.check_cron(cron)


def test_never_firing_cron():
    with pytest.raises(ValueError, match="never fires"):
        next_run("0 0 30 2 *", D(2026, 1, 1))
    # cron would fire on April's Mondays, croniter never: refused, whatever the weekday says.
    with pytest.raises(ValueError, match="never fires: no month of '4' has day '31'"):
        parse_cron("0 3 31 4 1")
    assert next_run("0 3 29 2 *", D(2026, 1, 1)) == D(2028, 2, 29, 3, 0)  # leap years only


def test_missing_cron_names_the_key_and_the_flag():
    with pytest.raises(UserError, match=r"^schedule.cron is not set: pass --cron"):
        schedule.check_cron(None)


# Europe/Berlin: 2026-03-29 02:00 CET -> 03:00 CEST; 2026-10-25 03:00 CEST -> 02:00 CET.
BERLIN = "Europe/Berlin"


@pytest.fixture
def berlin(monkeypatch):
    from zoneinfo import ZoneInfo

    monkeypatch.setenv("TZ", BERLIN)
    return ZoneInfo(BERLIN)


@pytest.mark.parametrize("cron, after, expected", [
    ("30 2 * * *", D(2026, 3, 28, 12, 0), D(2026, 3, 29, 3, 0)),  # 02:30 does not exist: at the change
    ("30 2 * * *", D(2026, 3, 29, 3, 0), D(2026, 3, 30, 2, 30)),
    ("0 * * * *", D(2026, 3, 29, 1, 0), D(2026, 3, 29, 3, 0)),  # no 02:00 that day
])
def test_a_time_the_spring_change_skips_fires_at_the_change(berlin, cron, after, expected):
    got = next_run(cron, after)
    assert got == expected
    aware = got.replace(tzinfo=berlin)
    assert aware.astimezone(datetime.UTC).astimezone(berlin).replace(tzinfo=None) == got  # it exists


def test_the_hour_the_autumn_change_repeats_fires_once(berlin):
    first_pass = D(2026, 10, 25, 2, 30, tzinfo=berlin)  # 02:30 CEST, the daily run has just fired
    assert next_run("30 2 * * *", first_pass) == D(2026, 10, 26, 2, 30, tzinfo=berlin)
    assert next_run("30 2 * * *", D(2026, 10, 24, 12, 0)) == D(2026, 10, 25, 2, 30)


def test_nothing_is_scheduled_in_the_repeated_hours_second_pass(berlin):
    # Its wall times name the first pass too: `sbatch --begin=02:15` would start the job at once.
    second_pass = D(2026, 10, 25, 2, 10, fold=1, tzinfo=berlin)  # 02:10 CET, an hour after 02:10 CEST
    got = next_run("*/15 * * * *", second_pass)
    assert got == D(2026, 10, 25, 3, 0, tzinfo=berlin) and got.utcoffset() == datetime.timedelta(hours=1)
    assert got - second_pass == datetime.timedelta(minutes=50)


def test_the_local_zone_follows_tz_and_falls_back_to_utc(monkeypatch):
    from hpc.launch.cron import local_zone

    monkeypatch.setenv("TZ", BERLIN)
    assert str(local_zone()) == BERLIN
    monkeypatch.setenv("TZ", "Not/AZone")
    assert local_zone() == datetime.UTC
