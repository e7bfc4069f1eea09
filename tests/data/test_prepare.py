"""Training reads the regenerated (on-policy) shards once they are complete."""

from __future__ import annotations

import json
from pathlib import Path

from hpc.config import load_config, to_object
from hpc.data.prepare import regeneration_pending, training_sources

ROOT = Path(__file__).resolve().parents[2]


def reads(cfg) -> list[list]:
    return [s.settings() for s in training_sources(cfg.data)]


def test_regenerated_shards_replace_the_sources_only_when_finished(tmp_path):
    src = tmp_path / "orig.jsonl"
    src.write_text("")
    cfg = to_object(load_config(ROOT / "configs" / "toy-cpu.yaml",
                                [f"data.sources=[{{path: {src}}}]", f"data.output_dir={tmp_path}"]))
    assert reads(cfg) == [[str(src), "train", None]] and regeneration_pending(cfg.data)
    regen = tmp_path / "regenerated"
    regen.mkdir()
    (regen / "manifest.json").write_text(json.dumps({"finished": False, "shards": []}))
    assert reads(cfg) == [[str(src), "train", None]]  # half done: not yet
    assert regeneration_pending(cfg.data)  # a hand-run `dspark train` is told it reads the sources as they are
    (regen / "manifest.json").write_text(json.dumps({"finished": True, "shards": []}))
    assert reads(cfg) == [[str(regen), "train", None]] and not regeneration_pending(cfg.data)
    cfg.data.regenerate = False
    assert reads(cfg) == [[str(src), "train", None]] and not regeneration_pending(cfg.data)


def _cfg(tmp_path, toy_target, data, *extra):
    return to_object(load_config(ROOT / "configs" / "toy-cpu.yaml", [
        f"verifier.model={toy_target}", f"data.sources=[{{path: {data}}}]", f"train.output_dir={tmp_path / 'run'}",
        f"data.output_dir={tmp_path / 'data'}", *extra]))


def _checkpoint(cfg, data_hash: str) -> None:
    import torch

    from hpc.formats.checkpoint_layout import TrainState
    from hpc.train.checkpoint import save_checkpoint

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    save_checkpoint(Path(cfg.train.output_dir) / "checkpoints", model, {}, opt,
                    TrainState(step=5, data_hash=data_hash), None, keep=2)


def test_a_resume_reuses_its_prepared_data_or_refuses_in_one_line(tmp_path, toy_target):
    import pytest

    from hpc.data.prepare import prepare_data, prepared_hash
    from hpc.errors import UserError
    from hpc_dev.toy_data import write_toy_conversations

    data = write_toy_conversations(tmp_path / "train.jsonl", n=24, seed=2)
    cfg = _cfg(tmp_path, toy_target, data)
    first = prepare_data(cfg)
    rows = first.rows_file.read_bytes()
    _checkpoint(cfg, prepared_hash(cfg.train.output_dir))
    # New rows appended to the source: re-tokenising would renumber; the resume keeps its data.
    write_toy_conversations(data, n=30, seed=9)
    again = prepare_data(cfg)
    assert again.rows_file.read_bytes() == rows
    # Changed settings: one line, nothing rewritten.
    with pytest.raises(UserError, match=r"trained on other data \(max_seq_len changed\)") as info:
        prepare_data(_cfg(tmp_path, toy_target, data, "data.max_seq_len=200"))
    assert "\n" not in str(info.value) and first.rows_file.read_bytes() == rows
    # Holding other rows out mid-run would calibrate on rows already trained: refused the same way.
    with pytest.raises(UserError, match=r"trained on other data \(hold_out_every changed\)"):
        prepare_data(_cfg(tmp_path, toy_target, data, "train.hold_out_every=5"))
    # Prepared files swapped under the checkpoint: refused too.
    first.rows_file.write_bytes(rows.replace(b'"id": 3,', b'"id": 33,'))
    with pytest.raises(UserError, match="not the ones step_00000005 was trained on"):
        prepare_data(cfg)


def test_held_out_rows_do_not_choose_the_draft_vocabulary(tmp_path, toy_target):
    from safetensors.torch import load_file

    from hpc.data.prepare import load_prepared, prepare_data, split_held_out
    from hpc_dev.toy_data import write_toy_conversations

    data = write_toy_conversations(tmp_path / "train.jsonl", n=20, seed=3)
    counts = {}
    for every in (0, 4):
        cfg = _cfg(tmp_path / str(every), toy_target, data, f"train.hold_out_every={every}")
        prepare_data(cfg)
        rows, vocab = load_prepared(cfg.train.output_dir)
        counts[every] = load_file(str(vocab))["counts"]
    trained, held = split_held_out(rows, 4)
    assert held and trained

    def tally(part):
        import torch

        c = torch.zeros_like(counts[0])
        for ids, mask in part.values():
            for t, m in zip(ids, mask):
                c[t] += m
        return c

    # Every row counts without a hold-out; with one, only the rows that train.
    assert counts[0].tolist() == tally(rows).tolist()
    assert counts[4].tolist() == tally(trained).tolist() != counts[0].tolist()


def test_each_response_is_cut_to_what_decoding_at_the_cap_emits():
    from hpc.data.prepare import cap_responses

    mask = [0, 1, 1, 1, 1, 0, 0, 1, 1, 1]  # two assistant turns
    assert cap_responses(mask, 2) == [0, 1, 1, 0, 0, 0, 0, 1, 1, 0]
    assert cap_responses(mask, 4) == mask
