"""Training rows: chat data -> token ids + assistant loss mask, with bad rows counted.

Inputs are open-perfectblend-style `conversations=[{from, value}]` or OpenAI-style
`messages=[{role, content}]`, from local JSONL/parquet or a Hugging Face dataset id. The loss
mask comes from the render boundary of the target's own chat template, which works for any
template: render conv[:j] with the generation prompt and conv[:j+1] in full; the tokens past
their common prefix belong to assistant turn j.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from hpc.errors import UserError
from hpc.hub import hub_offline, offline_requested

ROLE_OF = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


@dataclass
class TokenRow:
    sample_id: int
    input_ids: list[int]
    loss_mask: list[int]


@dataclass
class RowStats:
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)

    def summary(self) -> str:
        why = ", ".join(f"{k}={v}" for k, v in sorted(self.skipped.items())) or "none"
        return f"{self.kept} rows kept, {sum(self.skipped.values())} skipped ({why})"


def to_messages(row: dict) -> list[dict]:
    """Either input shape -> [{role, content}]; raises ValueError on anything else."""
    if "messages" in row:
        msgs = [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
    elif "conversations" in row:
        msgs = [{"role": ROLE_OF[t["from"]], "content": t["value"]} for t in row["conversations"]]
    else:
        raise ValueError("row has neither `messages` nor `conversations`")
    for m in msgs:
        if m["role"] not in ("system", "user", "assistant") or not isinstance(m["content"], str):
            raise ValueError(f"bad turn {m!r:.60}")
    return msgs


def _jsonl_rows(path: Path) -> Iterator[dict]:
    """Rows of a JSONL file; a line that is not a JSON object is named, with its number."""
    with path.open(encoding="utf-8", errors="strict") as f:
        try:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as err:  # JSONDecodeError, or a plain ValueError (an int past the digit limit)
                    why = err.msg if isinstance(err, json.JSONDecodeError) else str(err)
                    raise UserError(f"{path}:{i}: not valid JSON ({why}); fix or delete that line") from None
                if not isinstance(row, dict):
                    raise UserError(f"{path}:{i}: a JSON {type(row).__name__}, expected an object per line")
                yield row
        except UnicodeDecodeError as err:
            raise UserError(f"{path}: not UTF-8 text (byte {err.start}); convert the file to UTF-8") from None


def read_rows(path: str, split: str = "train", max_rows: int | None = None) -> Iterator[dict]:
    """Local .jsonl / .parquet files (or a directory of them), else a Hugging Face dataset id."""
    p = Path(path).expanduser()
    files = sorted(p.glob("*.jsonl")) + sorted(p.glob("*.parquet")) if p.is_dir() else [p]
    if p.exists():
        n = 0
        for f in files:
            if f.suffix == ".parquet":
                import pyarrow.parquet as pq  # pyarrow: loaded only on this path

                rows = pq.read_table(f).to_pylist()
            else:
                rows = _jsonl_rows(f)
            for row in rows:
                if max_rows is not None and n >= max_rows:
                    return
                n += 1
                yield row
        return
    try:
        import datasets  # optional: its absence is handled here
    except ImportError:
        raise UserError(f"{path} is not a local file and the `datasets` package is missing to load it "
                        "from the hub; pip install datasets, or point data.sources[].path at a local copy") from None
    try:
        with hub_offline(offline_requested()):
            ds = datasets.load_dataset(path, split=split, streaming=True)
    except Exception as err:  # noqa: BLE001 - offline clusters fail here with many exception types
        raise UserError(f"cannot load dataset {path!r} ({str(err).splitlines()[0]}); download it and set "
                        "data.sources[].path to the local directory") from None
    for i, row in enumerate(ds):
        if max_rows is not None and i >= max_rows:
            return
        yield row


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def tokenize_conversation(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(input ids, loss mask) with 1 exactly on the assistant turns' tokens."""
    def render(msgs, gen):
        return list(tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen,
                                                  return_dict=False))

    full = render(messages, False)
    mask = [0] * len(full)
    for j, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(messages[:j], True)
        upto = render(messages[: j + 1], False)
        start, end = _common_prefix(before, upto), len(upto)
        if full[:end] != upto:
            raise ValueError("chat template is not prefix-stable; cannot place the assistant turn")
        mask[start:end] = [1] * (end - start)
    return full, mask


def tokenize_rows(tokenizer, rows: Iterator[dict], max_seq_len: int, stats: RowStats | None = None) -> Iterator[TokenRow]:
    stats = stats if stats is not None else RowStats()
    for i, row in enumerate(rows):
        try:
            msgs = to_messages(row)
        except (ValueError, KeyError, TypeError):
            stats.skipped["malformed"] += 1
            continue
        if not any(m["role"] == "assistant" and m["content"] for m in msgs):
            stats.skipped["no_assistant_turn"] += 1
            continue
        try:
            ids, mask = tokenize_conversation(tokenizer, msgs)
        except Exception:  # noqa: BLE001 - undecodable text or a template error: this row only
            stats.skipped["undecodable"] += 1
            continue
        if len(ids) > max_seq_len:
            stats.skipped["too_long"] += 1
            continue
        if not any(mask):
            stats.skipped["empty_loss_mask"] += 1
            continue
        stats.kept += 1
        yield TokenRow(i, ids, mask)
