"""Numerical parity with speculators 0.9.0's DSparkDraftModel, the reference implementation.

Our random draft is exported (the format vLLM serves); speculators loads that export with its
own `from_pretrained`, and both run the same packed row in fp32 in the speculators venv
(tests/peers/speculators_parity.py). Its pins clash with ours, hence the separate venv.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from hpc.model.export import export_draft
from tests.fixtures.speculators import speculators_python  # noqa: F401  (fixture)
from tests.model.test_dspark import tiny_model

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "peers" / "speculators_parity.py"
TOL = 1e-4
CASES = ["anchor", "anchor_packed", "bonus", "bonus_packed"]


def exported(tmp: Path, name: str, **kw) -> Path:
    """A random tiny draft (hidden == target hidden, as speculators sizes `fc` by it), exported."""
    model = tiny_model(seed=3, **kw)
    assert model.args.hidden_size == model.args.target_hidden_size
    t2d = torch.zeros(model.args.target_vocab_size, dtype=torch.bool)
    t2d[torch.arange(model.args.draft_vocab_size) + model.d2t] = True
    model.t2d.copy_(t2d)  # speculators slices its verifier lm_head with t2d
    return export_draft(model, tmp / name)


@pytest.fixture(scope="module")
def parity(speculators_python, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("parity")
    bonus = exported(tmp, "bonus", block_size=4, sample_from_anchor=False)
    cases = {
        # DSpark default: slot k predicts p+k+1; Markov head on; confidence head fed [h ; w1[prev]].
        "anchor": f"{exported(tmp, 'anchor', block_size=4)}:40",
        "anchor_packed": f"{exported(tmp, 'anchor8', block_size=8)}:26,30",
        # DFlash slot layout (slot 0 is the bonus), which speculators' DSpark also trains.
        "bonus": f"{bonus}:40",
        "bonus_packed": f"{bonus}:24,20",
    }
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([str(speculators_python), str(SCRIPT), *(f"{k}={v}" for k, v in cases.items())],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", CASES)
def test_draft_and_confidence_logits_match_speculators(parity, case):
    r = parity[case]
    print(f"{case}: logits {r['logits_max_abs_diff']:.2e} (scale {r['logits_scale']:.1f}), "
          f"confidence {r['conf_max_abs_diff']:.2e}, targets {r['targets_max_abs_diff']:.2e}, "
          f"{r['n_anchors']} anchors")
    assert r["weights_differ"] == [], "speculators loaded different tensors from our export"
    assert r["n_anchors"] > 10
    assert r["logits_max_abs_diff"] < TOL
    assert r["conf_max_abs_diff"] < TOL
    assert r["targets_max_abs_diff"] < TOL


@pytest.mark.parametrize("case", CASES)
def test_objective_matches_speculators_losses(parity, case):
    """Our objective on speculators' own logits/targets/mask equals its eager CE/TV/BCE losses."""
    for term, (ours, theirs) in parity[case]["objective"].items():
        assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-6), term


@pytest.mark.parametrize("case", ["anchor", "bonus"])
def test_end_to_end_loss_matches_speculators(parity, case):
    """One document: the supervised slots agree, so the whole training losses must too."""
    r = parity[case]
    assert r["masks_agree"]
    ours, theirs = r["end_to_end_loss"]
    assert ours == pytest.approx(theirs, rel=1e-5)


def test_supervised_slots_differ_only_across_documents(parity):
    """Deliberate: a block running past its document's end is not supervised by us (its target
    is the next document's token, whose context the block cannot see); speculators supervises it."""
    d = parity["anchor_packed"]["mask_diff"]
    assert d["only_ours"] == 0
    assert d["only_theirs"] == d["only_theirs_cross_doc"] > 0
