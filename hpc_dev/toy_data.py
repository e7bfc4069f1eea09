"""Toy chat data for the CPU pipeline: questions from the toy target's corpus (toy_corpus.py).

Each row is a user question about the Python standard library with the documentation's answer;
one in four has a follow-up question. It is only a stand-in for open-perfectblend: the
regeneration stage replaces the assistant turns with the toy target's own outputs (on-policy data).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from hpc.config import load_config, to_object
from hpc.data.calibration_set import write_calibration_set
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


def toy_traffic(n: int, seed: int, exclude: set[str]) -> list[dict]:
    """Up to `n` single-turn conversations on questions of the corpus that `exclude` (the
    training rows' questions) lacks, each question once: a sample of the toy's own traffic that
    training never saw, for the calibration set."""
    rng = random.Random(seed)
    seen = set(exclude)
    pool = []
    for q, a in split(exchanges())[0]:
        if q not in seen:
            seen.add(q)
            pool.append((q, a))
    rng.shuffle(pool)
    return [{"id": f"traffic-{i}", "source": "toy-traffic",
             "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
            for i, (q, a) in enumerate(pool[:n])]


def _questions(paths: list[str]) -> set[str]:
    """Every user turn of these JSONL files."""
    out = set()
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if line.strip():
                out |= {t["value"] for t in json.loads(line).get("conversations", []) if t.get("from") == "human"}
    return out


CALIBRATION_ROWS = 16  # spare rows per benchmark: the math fixtures have 14, livecodebench 16, humaneval 158


def calibration_overrides(config: str, out: Path, overrides: list[str], traffic: int = 0) -> list[str]:
    """Calibrate on the serving distribution: a calibration set of the benchmark rows no
    evaluation reads (`dspark calibration-set`), written under `out`, as config overrides to put
    before the user's (an explicit setting wins). Only where the data is regenerated: the set is
    prompts, which the regenerate stage answers; otherwise [] and the held-out rows calibrate.

    With `traffic`, that many toy conversations no training row asks (`toy_traffic`) join the
    set, as a deployment adds a sample of its own traffic: the benchmarks spare 74 rows, too few
    to fit or judge a map past position 3 (on them 19 slots reached position 4, none position 6;
    3,000 traffic rows gave 772 at position 7)."""
    cfg = to_object(load_config(config, overrides))
    if not cfg.data.regenerate or cfg.data.calibration_sources:
        return []
    paths = [write_calibration_set(cfg.eval, out / "calibration.jsonl", CALIBRATION_ROWS)[1]]
    if traffic:
        trained = _questions([s.path for s in cfg.data.sources if s.path.endswith(".jsonl") and Path(s.path).is_file()])
        rows = toy_traffic(traffic, seed=2, exclude=trained)
        paths.append(out / "traffic.jsonl")
        write_text(paths[-1], "".join(json.dumps(r) + "\n" for r in rows))
    # The held-out rows would sit unused: train on them.
    return [f"data.calibration_sources=[{', '.join(f'{{path: {p}}}' for p in paths)}]", "train.hold_out_every=0"]


def write_toy_conversations(out: str | Path, n: int = 256, seed: int = 0) -> Path:
    """JSONL in the open-perfectblend shape, written atomically."""
    out = Path(out)
    write_text(out, "".join(json.dumps(row) + "\n" for row in toy_conversations(n, seed)))
    return out
