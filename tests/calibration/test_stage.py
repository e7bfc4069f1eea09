"""The calibrate stage: held-out rows captured, the map fitted and written into the export."""

from __future__ import annotations

import json
import random

import pytest
import torch

from hpc.calibration.stage import calibrate_export
from hpc.config.schema import DSparkConfig, VerifierBackend
from hpc.data.prepare import split_held_out
from hpc.errors import UserError
from hpc.formats.calibration import FILE, Calibration
from hpc.formats.vocab_map import mapping_from_selected
from hpc.model.dspark import DSparkDraft
from hpc.model.export import export_draft, load_draft
from hpc.model.target_weights import load_target_tensors
from tests.fixtures.draft import toy_draft_args
from tests.train.test_resume import H, V, target_dir  # noqa: F401 - the tiny random Qwen3 target, a fixture

D = 64


def _draft(target_dir, confidence: bool = True) -> DSparkDraft:
    torch.manual_seed(1)
    args = toy_draft_args(hidden_size=H, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      intermediate_size=64, block_size=4, draft_vocab_size=D, mask_token_id=V - 1, markov_rank=8,
                      target_hidden_size=H, target_vocab_size=V, aux_layer_ids=[1, 2, 3],
                      enable_confidence_head=confidence, confidence_head_with_markov=confidence)
    model = DSparkDraft(args)
    d2t, t2d = mapping_from_selected(torch.arange(D), V)
    model.d2t.copy_(d2t)
    model.t2d.copy_(t2d)
    model.embed_tokens.weight.data.copy_(load_target_tensors(target_dir)["embed_tokens"])
    return model


def _run_dir(tmp_path, target_dir, every: int = 4, rows: int = 24, confidence: bool = True) -> DSparkConfig:
    out = tmp_path / "train"
    g = random.Random(0)
    (out / "data").mkdir(parents=True)
    with open(out / "data" / "rows.jsonl", "w") as f:
        for i in range(rows):
            T = g.randint(16, 24)
            f.write(json.dumps({"id": i, "input_ids": [g.randrange(V - 1) for _ in range(T)],
                                "loss_mask": [0] * 4 + [1] * (T - 4)}) + "\n")
    export_draft(_draft(target_dir, confidence), out / "export")
    cfg = DSparkConfig()
    cfg.verifier.model, cfg.verifier.backend, cfg.verifier.aux_layer_ids = str(target_dir), VerifierBackend.hf, [1, 2, 3]
    cfg.train.output_dir, cfg.train.device, cfg.train.dtype = str(out), "cpu", "float32"
    cfg.train.hold_out_every = every
    return cfg


def test_held_out_rows_are_picked_by_id_and_train_nobody():
    rows = {i: ([i], [1]) for i in range(10)}
    train, held = split_held_out(rows, 4)
    assert sorted(held) == [3, 7] and sorted(train) == [0, 1, 2, 4, 5, 6, 8, 9]
    assert split_held_out(rows, 0) == (rows, {})


def test_the_stage_fits_on_the_held_out_rows_and_writes_the_map_into_the_export(target_dir, tmp_path, capsys):
    cfg = _run_dir(tmp_path, target_dir)
    export = tmp_path / "train" / "export"
    metrics = calibrate_export(cfg, quiet=True)
    cal = Calibration.load(export)
    assert cal is not None and set(cal.maps) == {"greedy", "sampling"}
    assert len(cal.maps["greedy"]) == 4  # one map per drafted position of block_size 4 (sample_from_anchor)
    assert load_draft(export).confidence_calibration is not None  # what the evals load
    assert metrics["calibration_rows"] == 6  # ids 3, 7, ..., 23
    assert metrics["calibration_slots"] == cal.fitted_on > 0
    # Cross-fitted ECE per position: real numbers in [0, 1] for every position decoding reached.
    eces = {k: v for k, v in metrics.items() if k.startswith("ece_")}
    assert "ece_sampling_pos1" in eces and all(0.0 <= v <= 1.0 for v in eces.values())
    # The survival to 1 is slot 1 itself, over the same blocks with the same weights: the block
    # ids held_out_slots records put each slot in its block.
    # (to float32: the slot ECE is summed in it)
    assert metrics["ece_survival_greedy_pos1"] == pytest.approx(metrics["ece_greedy_pos1"], abs=1e-6)
    assert metrics["ece_survival_sampling_pos1"] == pytest.approx(metrics["ece_sampling_pos1"], abs=1e-6)
    assert "ece_survival_greedy_pos2" in metrics
    # The raw head's survival (vLLM serves the head without the side file's maps) is reported too.
    assert all(0.0 <= metrics[f"ece_survival_raw_{m}_pos1"] <= 1.0 for m in ("greedy", "sampling"))
    out = capsys.readouterr().out
    assert "fitted on 6 held-out rows" in out and "cross-fitted" in out and f"wrote {export} (served head" in out
    assert "survival ECE" in out
    # The served head: one map folded into the exported weights (recorded in config.json, with the
    # rows it came from), or a line saying why the head stays raw.
    fold = json.loads((export / "config.json").read_text()).get("confidence_fold")
    assert "served head: " in out, out
    if fold is None:
        assert "stays raw" in out and "fold_a" not in metrics
    else:
        assert fold["mode"] == "greedy" and fold["fitted_on"]["rows"] == 6 and fold["fitted_on"]["where"] == "held-out rows"
        assert (fold["a"], fold["b"]) == (metrics["fold_a"], metrics["fold_b"])
        assert "ece_survival_served_greedy_pos1" in metrics
        assert load_draft(export).confidence_fold is not None


def test_a_second_run_fits_the_raw_head_again_not_the_stored_map(target_dir, tmp_path):
    cfg = _run_dir(tmp_path, target_dir)
    export = tmp_path / "train" / "export"
    calibrate_export(cfg, quiet=True)
    first, fold = Calibration.load(export), json.loads((export / "config.json").read_text())["confidence_fold"]
    calibrate_export(cfg, quiet=True)
    # The export's head holds the first fold; the second fit undoes it (to within fp32 rounding)
    # rather than fitting a map on top of it, which would read a ~ 1, b ~ 0.
    again = json.loads((export / "config.json").read_text())["confidence_fold"]
    assert again["a"] == pytest.approx(fold["a"], rel=1e-4) and again["b"] == pytest.approx(fold["b"], rel=1e-4)
    second = Calibration.load(export)
    assert first is not None and second is not None
    for mode, maps in first.maps.items():
        assert [x for ab in second.maps[mode] for x in ab] == pytest.approx([x for ab in maps for x in ab], rel=1e-4)
    # A calibrated export is still an export: a re-export (a resumed training's) may replace it.
    export_draft(_draft(target_dir), export)
    assert not (export / FILE).exists()


def test_nothing_to_calibrate_is_one_line_and_no_file(target_dir, tmp_path, capsys):
    cfg = _run_dir(tmp_path, target_dir, every=0)
    assert calibrate_export(cfg) == {}
    assert "train.hold_out_every is 0" in capsys.readouterr().out
    cfg.train.hold_out_every = 50  # more than the 24 rows: none held out
    assert calibrate_export(cfg) == {}
    assert "none held out at train.hold_out_every=50" in capsys.readouterr().out
    assert not (tmp_path / "train" / "export" / FILE).exists()


def test_a_draft_without_a_confidence_head_is_left_as_it_is(target_dir, tmp_path, capsys):
    cfg = _run_dir(tmp_path, target_dir, confidence=False)
    assert calibrate_export(cfg) == {}
    assert "no confidence head" in capsys.readouterr().out


def test_no_export_says_which_stage_comes_first(tmp_path):
    cfg = DSparkConfig()
    cfg.train.output_dir, cfg.train.hold_out_every = str(tmp_path), 4
    with pytest.raises(UserError, match="no exported draft to calibrate; the train stage must finish first"):
        calibrate_export(cfg)


def test_a_bad_capture_costs_its_row_not_the_stage(target_dir, tmp_path, capsys):
    from hpc.calibration import stage as calibrate_stage
    from hpc.verifier.hf_backend import HFVerifier

    hf = HFVerifier(str(target_dir), [1, 2, 3])

    def capture(i, ids, mask):
        if i == 7:
            raise ValueError("corrupt capture file")
        return hf.capture(i, ids, mask)

    _run_dir(tmp_path, target_dir)
    rows = split_held_out(json_rows(tmp_path), 4)[1]
    fitted = calibrate_stage.fit_held_out(load_draft(tmp_path / "train" / "export"), _head(target_dir), capture,
                                          rows, quiet=True)
    assert fitted.rows == 6 and "row 7 skipped: corrupt capture file" in capsys.readouterr().out
    assert fitted.calibration.fitted_on > 0  # the other five rows still fitted it


def json_rows(tmp_path) -> dict:
    from hpc.data.prepare import read_token_rows

    return read_token_rows(tmp_path / "train" / "data" / "rows.jsonl")


def _head(target_dir):
    from hpc.model.loss import VerifierHead

    _, t2d = mapping_from_selected(torch.arange(D), V)
    return VerifierHead(load_target_tensors(target_dir)["lm_head"].float(), t2d)


def test_rows_without_a_drafted_slot_say_so_in_one_line(target_dir, tmp_path):
    from hpc.calibration import stage as calibrate_stage
    from hpc.verifier.hf_backend import HFVerifier

    _run_dir(tmp_path, target_dir)
    rows = {i: (ids, [0] * len(mask)) for i, (ids, mask) in split_held_out(json_rows(tmp_path), 4)[1].items()}
    hf = HFVerifier(str(target_dir), [1, 2, 3])
    with pytest.raises(UserError, match="no held-out slots.*gave none"):
        calibrate_stage.fit_held_out(load_draft(tmp_path / "train" / "export"), _head(target_dir), hf.capture, rows,
                                     quiet=True)


def test_calibrating_other_rows_than_training_held_out_is_refused(target_dir, tmp_path):
    cfg = _run_dir(tmp_path, target_dir, every=4)
    (tmp_path / "train" / "data" / "prepared.json").write_text(json.dumps({"settings": {"hold_out_every": 5}}))
    with pytest.raises(UserError, match="train.hold_out_every = 4, but .* every 5-th row; calibrate with "
                                        "train.hold_out_every=5"):
        calibrate_export(cfg)
