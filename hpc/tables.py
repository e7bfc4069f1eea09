"""Plain-text tables for logs and pipes: rich fits the columns to their contents.

No colour, no box, no wrapping (a row stays one line, whatever the terminal), two blanks
between columns, no trailing blanks:

    print("\\n".join(text_table(["impl", "median s"], [["ours", "1.250"]], right={1})))
"""

from __future__ import annotations

import io
from collections.abc import Collection, Sequence


def text_table(header: Sequence[str] | None, rows: Sequence[Sequence[str]], right: Collection[int] = ()) -> list[str]:
    """The lines of a table: the header's (if any), then one per row; columns in `right` are right-aligned."""
    from rich.console import Console  # rich: loaded only on this path (validate imports the plan, never prints it)
    from rich.table import Table  # rich: loaded only on this path

    ncols = len(header) if header is not None else max((len(r) for r in rows), default=0)
    table = Table(box=None, show_header=header is not None, pad_edge=False, header_style=None)
    for i in range(ncols):
        table.add_column(header[i] if header is not None else "", justify="right" if i in right else "left",
                         no_wrap=True)
    for row in rows:
        table.add_row(*row)
    out = io.StringIO()
    # Wide enough never to wrap or cut a cell; the table itself is only as wide as its columns.
    Console(file=out, width=100_000, color_system=None, markup=False, emoji=False, highlight=False).print(table)
    return [line.rstrip() for line in out.getvalue().splitlines()]
