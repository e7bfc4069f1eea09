"""Times in a config. Slurm time limits: the one parser that the config validator, the
login-node Slurm checks and the submitter all use, so a `cluster.time` one accepts the others
accept too. Instants (a traffic window's end): unix seconds or ISO 8601."""

from __future__ import annotations

import datetime

TIME_FIX = "use MM, HH:MM:SS or D-HH:MM:SS, e.g. 48:00:00"


def parse_slurm_time(s: str) -> int | None:
    """A Slurm time limit in minutes, seconds rounded up as Slurm does; None means no limit.

    Accepts MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, UNLIMITED and infinite. Like
    Slurm, fields are not range-checked (90:00 is 90 minutes). Raises ValueError otherwise.
    """
    text = str(s).strip()
    if text.lower() in {"unlimited", "infinite"}:
        return None
    days, sep, rest = text.partition("-")
    if not sep:
        days, rest = "0", text
    parts = rest.split(":")
    if not days.isdigit() or not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"not a Slurm time: {s!r}")
    nums = [int(p) for p in parts]
    if sep:  # after a day count the first field is hours: D-HH, D-HH:MM, D-HH:MM:SS
        h, m, sec = (nums + [0, 0])[:3]
    elif len(nums) == 3:
        h, m, sec = nums
    else:  # MM or MM:SS
        h, m, sec = 0, nums[0], (nums[1] if len(nums) == 2 else 0)
    seconds = ((int(days) * 24 + h) * 60 + m) * 60 + sec
    return -(-seconds // 60)


def parse_time(value) -> float | None:
    """Unix seconds, or ISO 8601 (a trailing Z allowed; naive = UTC); None when it is neither."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if not isinstance(value, str):
        return None
    try:
        t = datetime.datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        return None
    if t.tzinfo is None:
        t = t.replace(tzinfo=datetime.UTC)
    return t.timestamp()
