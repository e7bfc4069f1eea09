"""Progress of a regeneration run: a rich bar on a terminal, plain lines in batch logs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text


def count_rows(sources) -> int | None:
    """Input rows of local sources (cheap: parquet metadata, JSONL lines); None if any is on the hub."""
    total = 0
    for src in sources:
        p = Path(src.path).expanduser()
        if not p.exists():
            return None
        files = sorted(p.glob("*.jsonl")) + sorted(p.glob("*.parquet")) if p.is_dir() else [p]
        n = 0
        for f in files:
            if f.suffix == ".parquet":
                import pyarrow.parquet as pq  # pyarrow: loaded only on this path

                n += pq.read_metadata(f).num_rows
            else:
                with f.open() as fh:
                    n += sum(1 for line in fh if line.strip())
        total += n if src.max_rows is None else min(n, src.max_rows)
    return total


class RateColumn(ProgressColumn):
    def render(self, task: Task) -> Text:
        return Text(f"{task.speed:.2f} rows/s" if task.speed else "- rows/s")


class Reporter:
    """``advance()`` once per input row; ``log()`` prints above the bar (or plainly without one)."""

    def __init__(self, enabled: bool, total: int | None, completed: int, log: Callable[[str], None] = print):
        self._log = log
        self._bar: Progress | None = None
        self.written = 0
        if enabled:
            self._bar = Progress(
                TextColumn("regenerate"), BarColumn(), MofNCompleteColumn(),
                TextColumn("rows ({task.fields[written]} written)"),
                RateColumn(), TimeElapsedColumn(), TimeRemainingColumn(), console=Console(stderr=True))
            self._task = self._bar.add_task("regenerate", total=total, completed=completed, written=0)

    def __enter__(self) -> Reporter:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()

    def advance(self, written: bool) -> None:
        self.written += written
        if self._bar is not None:
            self._bar.update(self._task, advance=1, written=self.written)

    def log(self, line: str) -> None:
        if self._bar is not None:
            self._bar.console.print(line, markup=False, highlight=False)
        else:
            self._log(line)
