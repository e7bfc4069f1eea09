"""Whether a tracking URI names an MLflow store that exists, checked without writing to it.

A reader (`compare`, `watch`) must not create a store: MLflow makes the directory and a fresh
database for a mistyped sqlite path, and creates its tables in any SQLite file it opens, so an
empty or foreign file would be written to, and the user would read only that an experiment
does not exist. Servers (http) answer for themselves.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from urllib.parse import urlparse

from hpc.config.secrets import redact_uri


def missing_store(uri: str) -> str | None:
    """Why `uri` names no tracking store a reader may open (missing, empty, corrupt, no MLflow
    tables, a path the filesystem refuses), or None. Nothing is created or written."""
    try:
        return _store_problem(uri)
    except OSError as err:  # a name too long for the filesystem, a directory we may not enter
        return f"the tracking store {redact_uri(uri)[:80]!r} cannot be opened ({err.strerror}); check --tracking-uri"


def _store_problem(uri: str) -> str | None:
    parsed = urlparse(uri)
    if parsed.scheme == "sqlite":
        path = Path(uri.removeprefix("sqlite:///") if uri.startswith("sqlite:///") else parsed.path)
        if not path.is_file():
            return f"no tracking database at {path} ({redact_uri(uri)}); check --tracking-uri or tracking.uri"
        return _not_mlflow_sqlite(path)
    elif parsed.scheme in ("", "file"):
        path = Path(parsed.path if parsed.scheme == "file" else uri)
        if not path.is_dir():
            return f"no tracking store at {path}; check --tracking-uri or tracking.uri"
    return None


def _not_mlflow_sqlite(path: Path) -> str | None:
    """Why the file is no MLflow SQLite store, read read-only, or None. MLflow creates its tables
    in any database it opens: a reader on an empty or foreign file would write them there."""
    import sqlite3  # only for a SQLite store

    with path.open("rb") as fh:
        head = fh.read(16)
    if not head:
        return f"{path} is empty (0 bytes), not an MLflow tracking database; check --tracking-uri or tracking.uri"
    if head != b"SQLite format 3\0":
        return f"{path} is not an SQLite database; check --tracking-uri or tracking.uri"
    try:
        with contextlib.closing(sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True)) as db:
            tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.DatabaseError as err:
        return f"{path} cannot be read as SQLite ({err}); check --tracking-uri or tracking.uri"
    if not {"experiments", "runs"} <= tables:
        return f"{path} holds no MLflow tracking tables; check --tracking-uri or tracking.uri"
    return None
