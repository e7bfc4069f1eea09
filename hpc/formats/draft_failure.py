"""`draft_failed.json`: why one draft of a shared stream failed while the others trained on.

Several drafts trained from one verifier's stream (a sweep that shares it, the ablations) fail
alone: the launcher that saw a draft's ranks fail (`dspark train`, or that draft's trainer node
in a Slurm allocation, which then ends its task cleanly so the others go on) writes this file in
the draft's `train.output_dir`. That draft's later stages read it and refuse in one line, and
`dspark status` shows it on the draft's row. A re-run of its training removes it. Stdlib only:
the login node reads it.
"""

from __future__ import annotations

import json
from pathlib import Path

from hpc.fsio import write_text

FILE = "draft_failed.json"


def record(out_dir: str | Path, variant: str, cause: str) -> None:
    write_text(Path(out_dir) / FILE, json.dumps({"variant": variant, "cause": cause}))


def read(out_dir: str | Path) -> dict | None:
    """{"variant", "cause"} when this draft's training failed on its own; None otherwise."""
    try:
        found = json.loads((Path(out_dir) / FILE).read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) and "cause" in found else None


def clear(out_dir: str | Path) -> None:
    (Path(out_dir) / FILE).unlink(missing_ok=True)


def refusal(out_dir: str | Path, stage: str) -> str | None:
    """The one line a later stage of a failed draft ends with; None for a draft that trained."""
    found = read(out_dir)
    if found is None:
        return None
    return (f"{stage}: variant {found.get('variant', '?')}'s training failed, so there is no draft to {stage}: "
            f"{found['cause']} (the other variants' jobs go on; fix it and re-run this variant)")
