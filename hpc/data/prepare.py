"""Before any GPU work: tokenise the data, count assistant tokens, prune the draft vocab.

Writes `{output_dir}/data/rows.jsonl` and `{output_dir}/data/vocab.safetensors`; every trainer
and streamer rank reads those instead of redoing the work. `prepared.json` records the
settings they came from and their hash, which every checkpoint records too.

A resume must train on the very rows and vocabulary of its checkpoint: the ledger names
sample ids, and d2t/t2d must match the verifier head. So when `train.output_dir` holds a
checkpoint, the prepared data is reused as it is, never re-tokenised (which could renumber
rows or re-pick the vocabulary); if the data settings changed, or the prepared files are not
the ones the checkpoint was trained on, the run stops with one line before any rank starts.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from hpc.config.schema import DataConfig, DataSource, DSparkConfig
from hpc.data.calibration_set import decoded_tokens
from hpc.data.reader import read_source
from hpc.data.regen_shards import verify_shards
from hpc.data.regenerate import calibration_data, regeneration_complete
from hpc.data.sources import RowStats, TokenRow, tokenize_rows
from hpc.data.vocab import count_assistant_tokens, select_draft_vocab
from hpc.errors import UserError
from hpc.formats.checkpoint_layout import latest_checkpoint
from hpc.formats.vocab_map import FILE as VOCAB_FILE
from hpc.formats.vocab_map import mapping_from_selected, save_vocab
from hpc.fsio import atomic_path, write_text


@dataclass
class Prepared:
    rows_file: Path
    vocab_file: Path
    stats: RowStats
    filled: int  # draft-vocab slots filled with unseen ids (documented fill rule)


def write_rows(path: str | Path, rows: Iterable) -> Path:
    """Tokenised rows as JSONL (`{id, input_ids, loss_mask}`), written atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps({"id": r.sample_id, "input_ids": r.input_ids, "loss_mask": r.loss_mask}) + "\n")
    return path


def read_token_rows(path: str | Path) -> dict[int, tuple[list[int], list[int]]]:
    rows = {}
    for line in Path(path).read_text().splitlines():
        r = json.loads(line)
        rows[int(r["id"])] = (r["input_ids"], r["loss_mask"])
    return rows


def training_sources(data: DataConfig) -> list[DataSource]:
    """The regenerated (on-policy) shards once `dspark regenerate` has finished them, else the
    configured sources as they are."""
    regen = Path(data.output_dir) / "regenerated"
    manifest = regen / "manifest.json"
    if data.regenerate and manifest.is_file() and json.loads(manifest.read_text()).get("finished"):
        return [DataSource(str(regen), "train", None)]
    return list(data.sources)


def regeneration_pending(data: DataConfig) -> bool:
    """`data.regenerate` asks for on-policy rows that `dspark regenerate` has not finished: the
    sources are read as they are (the pipeline regenerates first; a hand-run `dspark train` may not)."""
    regen = str(Path(data.output_dir) / "regenerated")
    return data.regenerate and all(s.path != regen for s in training_sources(data))


def _tokenize(cfg: DSparkConfig, data: DataConfig,
              remask: Callable[[dict, list[int]], list[int]] | None = None) -> tuple[list[TokenRow], RowStats]:
    """`data`'s rows (its regenerated shards once finished), tokenised with the verifier's
    tokenizer; `remask(row, loss_mask)` may then narrow each row's loss mask."""
    from transformers import AutoTokenizer  # transformers: loaded only on this path

    tok = AutoTokenizer.from_pretrained(cfg.verifier.tokenizer or cfg.verifier.model,
                                        trust_remote_code=cfg.verifier.trust_remote_code)
    stats = RowStats()
    rows: list[TokenRow] = []
    sources = training_sources(data)
    if regeneration_pending(data):
        print(f"warning: data.regenerate is true but {Path(data.output_dir) / 'regenerated'} holds no finished "
              "regeneration: using data's sources as they are (not on-policy); run `dspark regenerate CONFIG` "
              "first, or set data.regenerate=false to silence this", flush=True)
    for src in sources:
        if src.path == str(Path(data.output_dir) / "regenerated"):
            verify_shards(src.path)  # each shard as the verifier wrote it, and nothing beside them
        # remask needs each row as read: tokenize_rows numbers the rows it is given (sample_id).
        raw = list(read_source(src)) if remask is not None else None
        for r in tokenize_rows(tok, iter(raw) if raw is not None else read_source(src),
                               cfg.data.max_seq_len, stats):
            if remask is not None and raw is not None:
                r.loss_mask = remask(raw[r.sample_id], r.loss_mask)
            rows.append(r)
    return rows, stats


def cap_responses(loss_mask: list[int], cap: int) -> list[int]:
    """The mask with each response (a run of 1s) cut to its first `cap` tokens: what decoding
    at max_tokens=cap emits of it. Exact when the mask covers the generated tokens only, as the
    toy's and Kimi's templates render it (one that adds a newline after EOS counts one more)."""
    out, run = [], 0
    for m in loss_mask:
        run = run + 1 if m else 0
        out.append(1 if m and run <= cap else 0)
    return out


def calibration_rows(cfg: DSparkConfig) -> dict[int, tuple[list[int], list[int]]]:
    """The calibration rows, tokenised as training rows are (regenerated ones once they are)."""
    cal = calibration_data(cfg.data)
    if cal is None:
        return {}
    if cfg.data.regenerate and not regeneration_complete(cal):
        raise UserError(f"data.calibration_sources are not regenerated yet ({Path(cal.output_dir) / 'regenerated'} "
                        "is not complete); run the regenerate stage first (`dspark regenerate CONFIG` answers them "
                        "too), or set data.regenerate=false to calibrate on the rows as they are")

    def remask(row: dict, mask: list[int]) -> list[int]:
        # A benchmark's spare row is read as its evaluation decodes it: regeneration answers at
        # data.regen_max_tokens (4096), the evaluation stops at eval.max_tokens (2048, 512 for code).
        cap = decoded_tokens(row, cfg.eval)
        return mask if cap is None else cap_responses(mask, cap)

    rows, stats = _tokenize(cfg, cal, remask)
    if not rows:
        raise UserError(f"no usable rows in data.calibration_sources ({stats.summary()}); check the paths. Rows "
                        "with no assistant turn (`dspark calibration-set` writes prompts) need data.regenerate=true")
    # Tokens after the last scored one change no slot: they are not captured (a 4096-token
    # regenerated reply cut at code_max_tokens=512 costs an eighth).
    ends = [max(j for j, m in enumerate(r.loss_mask) if m) + 1 for r in rows]
    return {i: (r.input_ids[:end], r.loss_mask[:end]) for i, (r, end) in enumerate(zip(rows, ends))}


PREPARED = "prepared.json"


def data_settings(cfg: DSparkConfig) -> dict:
    """What decides the rows and the vocabulary, and which rows train (the rest calibrate)."""
    v = cfg.verifier
    return {"sources": [s.settings() for s in training_sources(cfg.data)], "max_seq_len": cfg.data.max_seq_len,
            "draft_vocab_size": cfg.draft.draft_vocab_size, "vocab_size": v.vocab_size,
            "tokenizer": v.tokenizer or v.name or v.model, "hold_out_every": cfg.train.hold_out_every}


def data_hash(data_dir: Path) -> str:
    """sha256 over rows.jsonl and vocab.safetensors: the identity of the prepared data."""
    h = hashlib.sha256()
    for name in ("rows.jsonl", VOCAB_FILE):
        with open(data_dir / name, "rb") as f:
            h.update(hashlib.file_digest(f, "sha256").digest())
    return h.hexdigest()


def prepared_hash(out_dir: str | Path) -> str:
    """The hash of the prepared data under `out_dir`; "" when rows come from elsewhere (tests)."""
    data = Path(out_dir) / "data"
    if (data / PREPARED).is_file():
        return json.loads((data / PREPARED).read_text())["hash"]
    return data_hash(data) if (data / "rows.jsonl").is_file() and (data / VOCAB_FILE).is_file() else ""


def _reuse_for_resume(cfg: DSparkConfig, out: Path) -> Prepared | None:
    """The prepared data of the run being resumed, checked; None when there is nothing to resume."""
    ckpt = latest_checkpoint(Path(cfg.train.output_dir) / "checkpoints", say=lambda _: None)
    if ckpt is None:
        return None
    trained_on = json.loads((ckpt / "state.json").read_text()).get("data_hash", "")
    meta = json.loads((out / PREPARED).read_text()) if (out / PREPARED).is_file() else None
    where = f"train.output_dir={cfg.train.output_dir}"
    if meta is None or not (out / "rows.jsonl").is_file():
        if trained_on:
            raise UserError(f"{ckpt} needs the prepared data it was trained on, and {out} no longer holds it; "
                            f"restore it, or start over in a new {where.split('=')[0]}")
        return None  # a checkpoint from before data hashes: prepare and let it through
    # A run prepared before rows were held out held none out. Changing that mid-run would let rows
    # already trained on calibrate, or never train rows the ledger counts on.
    recorded = {"hold_out_every": 0, **meta["settings"]}
    if recorded != data_settings(cfg):
        changed = sorted(k for k in recorded if recorded[k] != data_settings(cfg).get(k))
        raise UserError(f"{where} holds checkpoints trained on other data ({', '.join(changed)} changed); "
                        "resume with the same data settings, or use a new train.output_dir to start over")
    if (trained_on and trained_on != meta["hash"]) or data_hash(out) != meta["hash"]:
        raise UserError(f"{out}: the prepared rows or vocabulary are not the ones {ckpt.name} was trained on; "
                        "restore them, or use a new train.output_dir to start over")
    stats = RowStats()
    stats.kept = sum(1 for _ in open(out / "rows.jsonl"))
    print(f"data: resuming {ckpt.name}, so the prepared data in {out} is reused as it is", flush=True)
    return Prepared(out / "rows.jsonl", out / VOCAB_FILE, stats, 0)


def prepare_data(cfg: DSparkConfig, out_dir: str | Path | None = None) -> Prepared:
    out = Path(out_dir or cfg.train.output_dir) / "data"
    if out_dir is None:
        reused = _reuse_for_resume(cfg, out)
        if reused is not None:
            return reused
    rows, stats = _tokenize(cfg, cfg.data)
    if not rows:
        raise UserError(f"no usable training rows in data.sources ({stats.summary()}); check the paths and "
                        "that rows hold conversations/messages with an assistant turn")
    for i, r in enumerate(rows):  # ids unique across sources
        r.sample_id = i
    rows_file = write_rows(out / "rows.jsonl", rows)
    vocab_size = cfg.verifier.vocab_size
    # The held-out rows calibrate the draft: they must not choose its vocabulary either.
    trained = split_held_out({r.sample_id: r for r in rows}, cfg.train.hold_out_every)[0].values()
    counts = count_assistant_tokens(((torch.tensor(r.input_ids), torch.tensor(r.loss_mask)) for r in trained),
                                    vocab_size)
    n = cfg.draft.draft_vocab_size
    seen = int((counts > 0).sum())
    d2t, t2d = mapping_from_selected(select_draft_vocab(counts, n, fill=True), vocab_size)
    vocab_file = save_vocab(out / VOCAB_FILE, d2t, t2d, counts)
    filled = max(0, n - seen)
    summary = {"rows_kept": stats.kept, **{f"rows_skipped_{k}": v for k, v in stats.skipped.items()},
               "draft_vocab_filled": filled}
    write_text(out / "stats.json", json.dumps(summary))
    write_text(out / PREPARED, json.dumps({"settings": data_settings(cfg), "hash": data_hash(out)}, indent=1))
    return Prepared(rows_file, vocab_file, stats, filled)


def load_prepared(out_dir: str | Path) -> tuple[dict, Path]:
    data = Path(out_dir) / "data"
    return read_token_rows(data / "rows.jsonl"), data / VOCAB_FILE


def split_held_out(rows: dict, every: int) -> tuple[dict, dict]:
    """(train, held out): every `every`-th sample id is held out (none when every is 0). By id,
    not by position, so a resumed run and the calibrate stage pick the very same rows."""
    if not every:
        return rows, {}
    held = {i: r for i, r in rows.items() if i % every == every - 1}
    return {i: r for i, r in rows.items() if i not in held}, held
