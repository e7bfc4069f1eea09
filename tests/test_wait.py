"""The shared polling helpers that the slow tests wait with (tests/fixtures/wait.py)."""

from __future__ import annotations

import itertools
import subprocess
import sys
import time

import psutil
import pytest

from tests.fixtures.wait import poll, still_running, wait_until


def test_wait_until_returns_the_first_truthy_value_without_calling_again():
    counter = itertools.count()
    calls = []

    def third() -> int | None:
        calls.append(n := next(counter))
        return n if n >= 2 else None

    assert wait_until(third, 5, 0.01) == 2
    assert calls == [0, 1, 2]


def test_wait_until_names_what_it_waited_for_and_reads_state_on_timeout():
    state = {"last": "none yet"}
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"drained \(last error: boom\): not reached within 0.2 s"):
        state["last"] = "boom"
        wait_until(lambda: False, 0.2, 0.05, lambda: f"drained (last error: {state['last']})")
    assert time.monotonic() - start < 2


def test_poll_returns_the_last_value_at_the_deadline_without_raising():
    counter = itertools.count()
    assert poll(lambda: next(counter), lambda n: n > 10**9, 0.1, 0.02) >= 1


def test_still_running_waits_for_exits_and_names_the_process_that_stays():
    quick = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    stays = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        procs = [psutil.Process(quick.pid), psutil.Process(stays.pid)]
        assert [p.pid for p in still_running(procs, timeout=3)] == [stays.pid]
        stays.kill()
        start = time.monotonic()
        assert still_running(procs, timeout=10) == []
        assert time.monotonic() - start < 5  # returns when they are gone, not at the timeout
    finally:
        stays.kill()
        quick.wait()
        stays.wait()
