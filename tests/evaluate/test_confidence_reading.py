"""eval.confidence: the reference engine reads what vLLM would serve (the export's head, its fold
in the weights) unless the side file's per-position maps are asked for, and the card says which."""

from __future__ import annotations

import json

import pytest
import torch

from hpc.config.schema import DSparkConfig, ServedConfidence
from hpc.errors import UserError
from hpc.evaluate.compare import EvalRecord, card_markdown, card_table
from hpc.evaluate.engines import ReferenceEngine
from hpc.evaluate.harness import BenchResult, finished, run_benchmarks
from hpc.evaluate.runner import check_side_file
from hpc.formats.calibration import Calibration, Fold
from hpc.model.export import export_draft, load_draft, refold_export
from tests.evaluate.test_harness import CharTokenizer, bench
from tests.evaluate.test_reference import random_draft, random_target
from tests.model.test_dspark import tiny_model


def _confidences(engine: ReferenceEngine) -> list[float]:
    return [c for confs, _ in engine.steps for c in confs]


def test_the_reference_engine_reads_the_served_head_unless_the_side_file_is_asked_for():
    target = random_target()
    draft = random_draft(target, [1, 2, 3])
    draft.confidence_fold = Fold(0.5, -1.0, "greedy")
    # A side-file map far from the fold, so the two readings cannot agree by chance.
    draft.confidence_calibration = Calibration({"greedy": [(2.0, 3.0)] * 8}, 100)
    ids = list(range(5, 25))
    served = ReferenceEngine(target, draft, 3, None)
    assert served.confidence == "served" and draft.confidence_calibration is None
    served.generate(ids, 8)
    draft.confidence_calibration = Calibration({"greedy": [(2.0, 3.0)] * 8}, 100)
    side = ReferenceEngine(target, draft, 3, None, confidence="side_file")
    assert side.confidence == "side_file" and draft.confidence_calibration is not None
    side.generate(ids, 8)
    assert [m for _, m in served.steps] == [m for _, m in side.steps]  # the drafts and verdicts are the same
    # served: sigmoid(0.5 z - 1); side file: sigmoid(2 z + 3), on the same raw logits z.
    z = torch.logit(torch.tensor(_confidences(served), dtype=torch.float64), eps=1e-12)
    want = torch.sigmoid(2.0 * ((z + 1.0) / 0.5) + 3.0)
    assert torch.allclose(torch.tensor(_confidences(side), dtype=torch.float64), want, atol=1e-4)
    assert ReferenceEngine(target, None, 0, None).confidence == ""  # a baseline reads no head


def test_a_result_read_one_way_is_not_reused_for_the_other(tmp_path):
    target = random_target()
    b = bench("gsm8k", ["one two"])
    res = run_benchmarks(ReferenceEngine(target, random_draft(target, [1, 2, 3]), 3, None), [b], CharTokenizer(),
                         tmp_path, "DSpark", "dspark", 3, quiet=True)[0]
    assert res.confidence == "served"
    assert json.loads((tmp_path / "gsm8k.json").read_text())["confidence"] == "served"
    assert finished(tmp_path, b, "reference", "cached", "served") is not None
    assert finished(tmp_path, b, "reference", "cached", "side_file") is None


def test_side_file_without_one_is_one_line_before_any_engine_starts(tmp_path):
    out = export_draft(tiny_model(), tmp_path / "draft", n=3)
    cfg = DSparkConfig()
    check_side_file(out, cfg)  # served: no side file needed
    cfg.eval.confidence = ServedConfidence.side_file
    with pytest.raises(UserError, match=r"eval.confidence=side_file, but .* has no confidence_calibration.json"):
        check_side_file(out, cfg)
    refold_export(out, Fold(1.5, 0.2, "greedy"), Calibration({"greedy": [(1.0, 0.0)] * 3}, 10))
    check_side_file(out, cfg)
    assert load_draft(out).confidence_calibration is not None
    # Its maps beside another head (a side file copied between exports): one line, either reading.
    other = export_draft(tiny_model(seed=1), tmp_path / "other", n=3)
    (other / "confidence_calibration.json").write_bytes((out / "confidence_calibration.json").read_bytes())
    cfg.eval.confidence = ServedConfidence.served
    with pytest.raises(UserError, match="fitted for another confidence head"):
        check_side_file(other, cfg)


def test_the_card_names_how_each_column_read_its_confidence():
    served = EvalRecord("p", "dspark", 7, {"gsm8k/accept_len": 1.7}, engine="reference", confidence="served")
    side = EvalRecord("p", "dspark", 3, {"gsm8k/accept_len": 1.5}, engine="reference", confidence="side_file")
    ngram = EvalRecord("p", "ngram", 7, {"gsm8k/accept_len": 1.2}, engine="vllm")
    text = card_markdown(card_table([served, side, ngram]), [served, side, ngram])
    line = next(x for x in text.splitlines() if x.startswith("confidence: "))
    assert "served (the exported head alone, its fold in the weights, as vLLM computes it): DSpark n=7" in line
    assert "side_file (confidence_calibration.json's per-position maps, which vLLM does not read): DSpark n=3" in line
    assert "ngram" not in line
    assert "confidence:" not in card_markdown(card_table([ngram]), [ngram])


def test_result_files_without_a_reading_still_load():
    d = {k: v for k, v in vars(BenchResult("gsm8k", 1, "0", "s", "vllm", "ngram", "ngram", 3, 1.0, 1, 1.0, 8)).items()
         if k != "confidence"}
    assert BenchResult.from_json(d).confidence == ""
