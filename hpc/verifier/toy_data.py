"""Toy chat data for the CPU pipeline: conversations cut from Python stdlib source.

Each conversation asks the target to continue a snippet of a stdlib module; the assistant
turn is the real continuation. It is only a stand-in for open-perfectblend: the regeneration
stage replaces the assistant turns with the toy target's own outputs (on-policy data).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from hpc.verifier.toy import corpus_files


def toy_conversations(n: int, seed: int = 0, prompt_lines: int = 6, answer_lines: int = 8) -> list[dict]:
    rng = random.Random(seed)
    files = corpus_files()
    rows = []
    while len(rows) < n:
        path = files[rng.randrange(len(files))]
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
        if len(lines) < prompt_lines + answer_lines:
            continue
        start = rng.randrange(len(lines) - prompt_lines - answer_lines + 1)
        snippet = "\n".join(lines[start:start + prompt_lines])
        answer = "\n".join(lines[start + prompt_lines:start + prompt_lines + answer_lines])
        rows.append({"id": f"toy-{len(rows)}", "source": path.name, "conversations": [
            {"from": "human", "value": f"Continue this code from {path.name}:\n{snippet}"},
            {"from": "gpt", "value": answer},
        ]})
    return rows


def write_toy_conversations(out: str | Path, n: int = 256, seed: int = 0) -> Path:
    """JSONL in the open-perfectblend shape, written atomically."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        for row in toy_conversations(n, seed):
            f.write(json.dumps(row) + "\n")
    tmp.replace(out)
    return out
