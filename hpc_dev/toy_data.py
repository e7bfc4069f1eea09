"""Toy chat data for the CPU pipeline: questions from the toy target's corpus (toy_corpus.py).

Each row is a user question about the Python standard library with the documentation's answer;
one in four has a follow-up question. It is only a stand-in for open-perfectblend: the
regeneration stage replaces the assistant turns with the toy target's own outputs (on-policy data).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from hpc.fsio import write_text
from hpc_dev.toy_corpus import exchanges, split


def toy_conversations(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    pool, _ = split(exchanges())
    rows = []
    for i in range(n):
        turns = []
        for q, a in rng.sample(pool, 2 if rng.random() < 0.25 else 1):
            turns += [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
        rows.append({"id": f"toy-{i}", "source": "stdlib-docs", "conversations": turns})
    return rows


def write_toy_conversations(out: str | Path, n: int = 256, seed: int = 0) -> Path:
    """JSONL in the open-perfectblend shape, written atomically."""
    out = Path(out)
    write_text(out, "".join(json.dumps(row) + "\n" for row in toy_conversations(n, seed)))
    return out
