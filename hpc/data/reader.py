"""One reader per `data.sources` kind: a dataset's rows as they are, or logged traffic's window."""

from __future__ import annotations

from collections.abc import Iterator

from hpc.config.schema import DataSource, SourceKind
from hpc.data.sources import read_rows
from hpc.data.traffic import traffic_rows


def read_source(src: DataSource) -> Iterator[dict]:
    if src.kind == SourceKind.traffic:
        return traffic_rows(src.path, src.max_age_days, src.until, src.max_rows)
    return read_rows(src.path, src.split, src.max_rows)
