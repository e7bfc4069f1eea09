"""The affine map folded into the served confidence head: fitted to the survival, exact in the
weights vLLM loads, and bound to its side file."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from hpc.calibration.fit import HeldOutSlots, concat_slots
from hpc.calibration.fold import fit_fold, folded, mean_survival_ece, survival_ece
from hpc.errors import UserError
from hpc.formats.calibration import FILE, Calibration, Fold
from hpc.model.export import export_draft, head_sha256, is_export, load_draft, refold_export
from tests.model.test_dspark import tiny_model


def blocks(n: int, seed: int, scale: float = 2.0, shift: float = 1.0, width: int = 4,
           visit: float = 1.0) -> HeldOutSlots:
    """n blocks of `width` slots, each accepted with a known chance once the earlier ones were;
    the head's logit says `scale` x the true logit + `shift` (overconfident and shifted)."""
    g = torch.Generator().manual_seed(seed)
    true_NK = torch.randn(n, width, generator=g) * 1.5 + 0.5
    accept_NK = (torch.rand(n, width, generator=g) < torch.sigmoid(true_NK)).float()
    # Slot k is read only once 1..k-1 were accepted: the reach, as held_out_slots weighs it.
    reach_NK = torch.cat([torch.ones(n, 1), accept_NK[:, :-1].cumprod(1)], 1) * visit
    pos = torch.arange(1, width + 1).expand(n, width)
    block = torch.arange(n)[:, None].expand(n, width)
    flat = lambda t: t.reshape(-1)  # noqa: E731
    reach = flat(reach_NK)
    return HeldOutSlots(flat(scale * true_NK + shift), flat(accept_NK), flat(torch.sigmoid(true_NK)), flat(pos),
                        {"greedy": reach, "sampling": reach}, flat(block))


def test_the_fold_undoes_a_known_distortion_and_calibrates_the_survival_on_rows_it_never_saw():
    fit_on = blocks(3000, seed=0)
    halves = (blocks(1500, seed=1), blocks(1500, seed=2))
    fit = fit_fold(fit_on, halves, "greedy", {"rows": 12})
    assert fit.fold is not None, fit.why
    # The inverse of 2 z + 1 is z / 2 - 1/2.
    assert abs(fit.fold.a - 0.5) < 0.05 and abs(fit.fold.b + 0.5) < 0.1, fit.fold
    assert fit.fold.fitted_on["rows"] == 12 and fit.fold.fitted_on["blocks"] == 3000
    held_out = blocks(3000, seed=7)  # a seed no fit saw
    raw = survival_ece(held_out, "greedy", floors=True)
    served = survival_ece(folded(held_out, fit.fold.a, fit.fold.b), "greedy", floors=True)
    assert mean_survival_ece(served) < mean_survival_ece(raw) / 3
    assert all(e < max(0.03, floor + 0.02) for e, _, floor in served), served
    assert fit.survival is not None and mean_survival_ece(fit.survival) < mean_survival_ece(raw)


def test_sampling_folds_to_its_own_soft_event():
    fit = fit_fold(blocks(3000, seed=0, scale=0.5, shift=-0.2), None, "sampling")
    assert fit.fold is not None and fit.fold.mode == "sampling"
    assert abs(fit.fold.a - 2.0) < 0.1 and abs(fit.fold.b - 0.4) < 0.15, fit.fold


def test_too_few_blocks_fold_nothing_and_say_how_many():
    fit = fit_fold(blocks(200, seed=0, visit=0.1), None, "greedy")
    assert fit.fold is None and "20 greedy blocks" in fit.why and "more calibration rows" in fit.why


def test_a_head_that_ranks_backwards_is_not_folded():
    fit = fit_fold(blocks(3000, seed=0, scale=-1.0, shift=0.0), None, "greedy")
    assert fit.fold is None and "backwards" in fit.why


def test_a_calibrated_head_is_not_made_worse():
    """On a head already calibrated the fold is near identity; cross-fitted it must not read a
    worse mean survival ECE than the raw head, or nothing is folded."""
    halves = (blocks(1500, seed=1, scale=1.0, shift=0.0), blocks(1500, seed=2, scale=1.0, shift=0.0))
    fit = fit_fold(concat_slots(list(halves)), halves, "greedy")
    raw = mean_survival_ece(survival_ece(concat_slots(list(halves)), "greedy"))
    if fit.fold is not None:
        assert fit.survival is not None and mean_survival_ece(fit.survival) <= raw
        assert abs(fit.fold.a - 1.0) < 0.1 and abs(fit.fold.b) < 0.1
    else:
        assert "stays raw" in fit.why


def _vllm_confidences(tensors: dict[str, torch.Tensor], feats_KF: torch.Tensor) -> torch.Tensor:
    """vLLM 0.33's compute_confidence: sigmoid of one fp32 linear layer over [hidden ; markov embed]."""
    w, c = tensors["confidence_head.proj.weight"].float(), tensors["confidence_head.proj.bias"].float()
    return torch.sigmoid(feats_KF.float() @ w.T + c).squeeze(-1)


def test_vllms_formula_on_the_exported_tensors_is_the_reference_engines_served_confidence(tmp_path):
    model = tiny_model()
    model.confidence_fold = Fold(0.37, -0.81, "greedy", {"rows": 3})
    out = export_draft(model, tmp_path / "draft", n=3)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["confidence_fold"] == {"mode": "greedy", "a": 0.37, "b": -0.81, "fitted_on": {"rows": 3}}
    tensors = load_file(str(out / "model.safetensors"))
    raw = model.confidence_head.proj  # type: ignore[union-attr]
    assert not torch.allclose(tensors["confidence_head.proj.weight"], raw.weight)  # the file holds the fold

    served = load_draft(out).eval()  # no side file: what the reference engine decodes by default
    g = torch.Generator().manual_seed(3)
    for anchor_pos in (5, 9):
        ctx_TH = served.project_context(torch.randn(anchor_pos, 3, served.args.target_hidden_size, generator=g))
        anchor = int(torch.randint(0, 60, (1,), generator=g))
        drafts, confs = served.propose(ctx_TH, anchor, anchor_pos, 3)
        assert confs is not None
        # The features vLLM builds: each slot's hidden and the Markov embedding of the token before it.
        h_KH = served.block_hidden(ctx_TH, anchor, anchor_pos, 3)
        prev = torch.cat([torch.tensor([anchor]), drafts[:-1]])
        feats = torch.cat([h_KH, served.markov_embed(prev)], -1)
        assert torch.allclose(_vllm_confidences(tensors, feats), confs, atol=1e-5, rtol=0), anchor_pos
    # In memory the head is the raw one again: training, calibration and warm starts read that.
    assert torch.allclose(served.confidence_head.proj.weight, raw.weight, atol=1e-6)  # type: ignore[union-attr]
    assert served.confidence_fold == model.confidence_fold


def test_refold_rewrites_the_export_and_binds_its_side_file(tmp_path):
    model = tiny_model()
    out = export_draft(model, tmp_path / "draft", verifier="/models/toy", verifier_arch=["Qwen3ForCausalLM"], n=3)
    cal = Calibration({"greedy": [(1.0, 0.0)] * 3}, 10)
    refold_export(out, Fold(2.0, 0.5, "greedy"), cal)
    assert is_export(out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["confidence_fold"]["a"] == 2.0 and cfg["speculators_config"]["verifier"]["name_or_path"] == "/models/toy"
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    tensors = load_file(str(out / "model.safetensors"))
    assert json.loads((out / FILE).read_text())["head_sha256"] == head_sha256(tensors)
    # A second calibration refolds from the raw head, not on top of the first fold.
    refold_export(out, Fold(0.5, 0.0, "greedy"), cal)
    again = load_file(str(out / "model.safetensors"))
    assert torch.allclose(again["confidence_head.proj.weight"], 0.5 * model.confidence_head.proj.weight, atol=1e-6)  # type: ignore[union-attr]
    refold_export(out, None, cal)  # nothing folded: the raw head, and no record of a fold
    assert "confidence_fold" not in json.loads((out / "config.json").read_text())
    raw = load_file(str(out / "model.safetensors"))
    assert torch.allclose(raw["confidence_head.proj.bias"], model.confidence_head.proj.bias, atol=1e-6)  # type: ignore[union-attr]


def test_a_side_file_beside_another_head_is_one_line(tmp_path):
    a = export_draft(tiny_model(seed=0), tmp_path / "a", n=3)
    b = export_draft(tiny_model(seed=1), tmp_path / "b", n=3)
    refold_export(a, Fold(2.0, 0.5, "greedy"), Calibration({"greedy": [(1.0, 0.0)] * 3}, 10))
    (b / FILE).write_bytes((a / FILE).read_bytes())  # a's maps copied beside b's head
    with pytest.raises(UserError, match=r"fitted for another confidence head.*head_sha256.*calibrate"):
        load_draft(b)
    legacy = json.loads((a / FILE).read_text())
    del legacy["head_sha256"]  # files written before the hash load as they did
    (b / FILE).write_text(json.dumps(legacy))
    assert load_draft(b).confidence_calibration is not None


def test_a_damaged_fold_record_is_one_line(tmp_path):
    out = export_draft(tiny_model(), tmp_path / "d", n=3)
    cfg = json.loads((out / "config.json").read_text())
    cfg["confidence_fold"] = {"mode": "greedy", "a": -1.0, "b": 0.0}
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="confidence_fold is damaged"):
        load_draft(out)


def test_the_searched_ece_is_the_reported_one():
    """The ECE search bins as `survival_ece` reports, so the map it picks is judged by the figure printed."""
    from hpc.calibration.fold import _survival_eces, survival_grid

    slots = blocks(500, seed=3, visit=0.7)
    got = _survival_eces(survival_grid(slots, "greedy"), 0.6, -0.4)
    want = [e for e, _, _ in survival_ece(folded(slots, 0.6, -0.4), "greedy")]
    assert got.tolist() == pytest.approx(want, abs=1e-6)  # folded() rounds the logits to fp32


def test_the_fold_evens_out_its_worst_position():
    """A head whose miscalibration differs by position (sharper at slot 1): one map cannot fit
    every k, and the log loss alone leaves one k worst; the ECE search lowers the worst survival
    ECE, on rows it was not fitted on too."""
    from hpc.calibration.fold import _least_worst_ece, _log_loss_map, _survival_eces, survival_grid

    def skewed(seed: int) -> HeldOutSlots:
        s = blocks(4000, seed=seed)
        first = s.position == 1
        s.logit[first] = 1.75 * s.logit[first]  # slot 1 says more than the others
        return s

    grid = survival_grid(skewed(5), "greedy")
    log_loss = _log_loss_map(grid)
    searched = _least_worst_ece(grid, *log_loss)
    assert float(_survival_eces(grid, *searched).max()) < float(_survival_eces(grid, *log_loss).max()) - 0.005
    held_out = survival_grid(skewed(6), "greedy")
    assert float(_survival_eces(held_out, *searched).max()) < float(_survival_eces(held_out, *log_loss).max())
