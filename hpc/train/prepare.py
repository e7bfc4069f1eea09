"""Before any GPU work: tokenise the data, count assistant tokens, prune the draft vocab.

Writes `{output_dir}/data/rows.jsonl` and `{output_dir}/data/vocab.safetensors`; every trainer
and streamer rank reads those instead of redoing the work.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from hpc.errors import UserError
from hpc.model.vocab import count_assistant_tokens, mapping_from_selected, select_draft_vocab
from hpc.train.online import read_token_rows, save_vocab, write_rows
from hpc.verifier.data import RowStats, read_rows, tokenize_rows


@dataclass
class Prepared:
    rows_file: Path
    vocab_file: Path
    stats: RowStats
    filled: int  # draft-vocab slots filled with unseen ids (documented fill rule)


def training_sources(cfg) -> list[tuple[str, str, int | None]]:
    """The regenerated (on-policy) shards once `dspark regenerate` has finished them, else the
    configured sources as they are."""
    regen = Path(cfg.data.output_dir) / "regenerated"
    manifest = regen / "manifest.json"
    if cfg.data.regenerate and manifest.is_file() and json.loads(manifest.read_text()).get("finished"):
        return [(str(regen), "train", None)]
    return [(s.path, s.split, s.max_rows) for s in cfg.data.sources]


def prepare_data(cfg, out_dir: str | Path | None = None) -> Prepared:
    from transformers import AutoTokenizer

    out = Path(out_dir or cfg.train.output_dir) / "data"
    tok = AutoTokenizer.from_pretrained(cfg.verifier.tokenizer or cfg.verifier.model,
                                        trust_remote_code=cfg.verifier.trust_remote_code)
    stats = RowStats()
    rows = []
    for path, split, max_rows in training_sources(cfg):
        rows.extend(tokenize_rows(tok, read_rows(path, split, max_rows), cfg.data.max_seq_len, stats))
    if not rows:
        raise UserError(f"no usable training rows in data.sources ({stats.summary()}); check the paths and "
                        "that rows hold conversations/messages with an assistant turn")
    for i, r in enumerate(rows):  # ids unique across sources
        r.sample_id = i
    rows_file = write_rows(out / "rows.jsonl", rows)
    vocab_size = cfg.verifier.vocab_size
    counts = count_assistant_tokens(((torch.tensor(r.input_ids), torch.tensor(r.loss_mask)) for r in rows), vocab_size)
    n = cfg.draft.draft_vocab_size
    seen = int((counts > 0).sum())
    d2t, t2d = mapping_from_selected(select_draft_vocab(counts, n, fill=True), vocab_size)
    vocab_file = save_vocab(out / "vocab.safetensors", d2t, t2d, counts)
    filled = max(0, n - seen)
    summary = {"rows_kept": stats.kept, **{f"rows_skipped_{k}": v for k, v in stats.skipped.items()},
               "draft_vocab_filled": filled}
    (out / "stats.json").write_text(json.dumps(summary))
    return Prepared(rows_file, vocab_file, stats, filled)


def load_prepared(out_dir: str | Path) -> tuple[dict, Path]:
    data = Path(out_dir) / "data"
    return read_token_rows(data / "rows.jsonl"), data / "vocab.safetensors"
