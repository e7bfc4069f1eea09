"""The problem collector every login-node check writes to, and what counts as a path.

Each check appends one line `key = value: what is wrong; what to do`; values that are secrets
(a token under `verifier.env`, credentials in `tracking.uri`) are masked, since these lines
land in job logs too.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from hpc.config.secrets import shown

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".txt", ".arrow", ".safetensors", ".yaml")


def looks_like_path(value: str) -> bool:
    """Hub ids (org/name) are not checked on a login node; paths are. `data/train.jsonl` has
    the shape of a hub id but names a file: a file suffix or a second slash makes it a path."""
    return (value.startswith(("/", "./", "../", "~")) or Path(value).exists() or not _HUB_ID.match(value)
            or value.lower().endswith(_DATA_SUFFIXES))


class Checker:
    def __init__(self) -> None:
        self.problems: list[str] = []

    def fail(self, key: str, value: Any, message: str) -> None:
        self.problems.append(f"{key} = {shown(key, value)!r}: {message}")  # error lines land in job logs too

    def positive(self, key: str, value: float, fix: str = "") -> None:
        if value is None or value <= 0:
            self.fail(key, value, f"must be > 0{'; ' + fix if fix else ''}")

    def nonneg(self, key: str, value: float) -> None:
        if value is None or value < 0:
            self.fail(key, value, "must be >= 0")

    def one_of(self, key: str, value: Any, allowed: tuple) -> None:
        if value not in allowed:
            self.fail(key, value, f"must be one of {', '.join(map(str, allowed))}")

    def device(self, key: str, value: str) -> None:
        if not re.match(r"^(cpu|cuda|cuda:\d+|mps|xpu)$", value):
            self.fail(key, value, "must be cpu, cuda, cuda:N, mps or xpu")

    def path(self, key: str, value: str | None, what: str) -> None:
        if value and looks_like_path(value) and not Path(value).expanduser().exists():
            self.fail(key, value, f"{what} does not exist; fix the path or use a hub id")
