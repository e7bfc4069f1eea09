"""Post-hoc confidence calibration: the fit, the reach weights, and the export round trip."""

from __future__ import annotations

import torch

from hpc.calibration.fit import HeldOutSlots, ece_by_position, fit_calibration, held_out_slots, weighted_ece
from hpc.formats.calibration import FILE, Calibration
from hpc.model.export import export_draft, load_draft
from hpc.model.loss import VerifierHead
from tests.model import test_dspark as T


def synthetic_slots(n: int = 4000, seed: int = 0) -> HeldOutSlots:
    """Events drawn from a known chance, with the head's logit twice too confident and shifted."""
    g = torch.Generator().manual_seed(seed)
    true_logit = torch.randn(n, generator=g) * 1.5 - 0.5
    p = torch.sigmoid(true_logit)
    greedy = (torch.rand(n, generator=g) < p).float()
    position = torch.randint(1, 4, (n,), generator=g)
    logit = 2.0 * true_logit + 1.0  # what the head says
    ones = torch.ones(n)
    return HeldOutSlots(logit, greedy, p, position, {"greedy": ones, "sampling": ones})


def test_the_fit_undoes_a_known_distortion_and_brings_ece_down():
    slots = synthetic_slots()
    cal = fit_calibration(slots)
    for a, b in cal.maps["greedy"]:  # the inverse of 2x + 1: x/2 - 1/2
        assert abs(a - 0.5) < 0.1 and abs(b + 0.5) < 0.15
    before = ece_by_position(slots, None, "greedy")
    after = ece_by_position(slots, cal, "greedy")
    assert all(e > 0.1 for e, _ in before) and all(e < 0.05 for e, _ in after), (before, after)
    # Sampling's event is the soft chance itself: its fit is exact up to the optimiser.
    a, b = cal.maps["sampling"][0]
    assert abs(a - 0.5) < 0.02 and abs(b + 0.5) < 0.02


def test_ece_weighs_slots_by_how_often_decoding_reaches_them():
    conf = torch.tensor([0.9, 0.9, 0.1])
    event = torch.tensor([1.0, 1.0, 1.0])
    assert abs(weighted_ece(conf, event, torch.tensor([1.0, 1.0, 1.0])) - (2 / 3 * 0.1 + 1 / 3 * 0.9)) < 1e-6
    # A slot decoding never reaches does not count.
    assert abs(weighted_ece(conf, event, torch.tensor([1.0, 1.0, 0.0])) - 0.1) < 1e-6


def test_a_sparse_position_shares_the_pooled_map():
    slots = synthetic_slots()
    keep = (slots.position < 3) | (torch.arange(slots.position.numel()) < 10)  # position 3: a handful of slots
    sparse = HeldOutSlots(slots.logit[keep], slots.greedy[keep], slots.sampling[keep], slots.position[keep],
                          {m: w[keep] for m, w in slots.reach.items()})
    cal = fit_calibration(sparse)
    pooled = fit_calibration(HeldOutSlots(sparse.logit, sparse.greedy, sparse.sampling,
                                          torch.ones_like(sparse.position), sparse.reach))
    assert cal.maps["greedy"][2] == pooled.maps["greedy"][0]


def test_a_position_keeps_its_own_map_only_where_it_predicts_the_other_half_better(tmp_path):
    def half(seed: int, step_at_3: bool) -> HeldOutSlots:
        s = synthetic_slots(seed=seed)
        logit, greedy = s.logit.clone(), s.greedy.clone()
        at2, at3 = s.position == 2, s.position == 3
        logit[at2] = -logit[at2]  # the head is inverted at position 2: only its own map undoes that
        if step_at_3:  # one half's events at position 3 are a step its own map fits, and the other's are not
            greedy[at3] = (s.logit[at3] > 1.0).float()
        return HeldOutSlots(logit, greedy, s.sampling, s.position, s.reach)

    from hpc.calibration.fit import concat_slots

    a, b = half(1, step_at_3=True), half(2, step_at_3=False)
    both = concat_slots([a, b])
    cal = fit_calibration(both, halves=(a, b))
    assert cal.pooled_at["greedy"] == [3]
    pooled = fit_calibration(HeldOutSlots(both.logit, both.greedy, both.sampling, torch.ones_like(both.position),
                                          both.reach))
    assert cal.maps["greedy"][2] == pooled.maps["greedy"][0]
    assert cal.maps["greedy"][1][0] < 0  # position 2's own map flips the inverted head back
    assert fit_calibration(both).pooled_at["greedy"] == []  # without halves: every position has enough slots
    assert Calibration.load(cal.save(tmp_path).parent).pooled_at == cal.pooled_at


def test_held_out_slots_reach_greedy_only_after_matches(tmp_path):
    model = T.tiny_model().eval()
    torch.manual_seed(3)
    t2d = torch.zeros(T.V, dtype=torch.bool)
    t2d[torch.arange(T.D) + model.d2t] = True
    head = VerifierHead(torch.randn(T.V, T.H), t2d)
    slots = held_out_slots(model, [T.packed_row(), T.packed_row(seed=2)], head)
    assert slots.logit.numel() > 0 and int(slots.position.min()) == 1
    first = slots.position == 1
    assert torch.all(slots.reach["greedy"][first] == 1) and torch.all(slots.reach["sampling"][first] == 1)
    # Later slots are reached (greedy) only when 0/1, and (sampling) with a chance in [0, 1].
    assert set(slots.reach["greedy"].unique().tolist()) <= {0.0, 1.0}
    assert float(slots.reach["sampling"].min()) >= 0 and float(slots.reach["sampling"].max()) <= 1


def test_held_out_slots_run_to_each_documents_end_and_no_further():
    """Decoding drafts up to the last token, so calibration does (training stops B short); a slot
    whose token would lie past its document (or the row) has no label and is left out."""
    from hpc.model.blocks import select_anchors

    model = T.tiny_model().eval()
    t2d = torch.zeros(T.V, dtype=torch.bool)
    t2d[torch.arange(T.D) + model.d2t] = True
    row = T.packed_row()  # documents 0..9 and 10..23, prompts at 0, 1, 10, 11
    slots = held_out_slots(model, [row], VerifierHead(torch.randn(T.V, T.H), t2d))
    # One position-1 slot per anchor whose next token is in its document: 2..8 and 12..22.
    assert int((slots.position == 1).sum()) == 7 + 11
    assert select_anchors(row.loss_mask_T, model.args.block_size, 512).numel() == 16  # training's: none past 19
    # Slots per anchor p: the tokens p+1.. up to its document's last one, at most the block's B.
    ends = {p: (9 if p < 10 else 23) for p in [*range(2, 9), *range(12, 23)]}
    assert slots.logit.numel() == sum(min(model.args.block_size, end - p) for p, end in ends.items())


def test_the_export_carries_the_calibration_and_decoding_applies_it_per_mode(tmp_path):
    model = T.tiny_model().eval()
    ctx = torch.randn(6, model.args.hidden_size)
    _, raw = model.propose(ctx, anchor_id=3, anchor_pos=5, n=3)
    model.confidence_calibration = Calibration({"greedy": [(0.0, 2.0)], "sampling": [(0.0, -2.0)]}, 10)
    out = export_draft(model, tmp_path / "export")
    assert (out / FILE).is_file()
    back = load_draft(out)
    _, greedy = back.propose(ctx, anchor_id=3, anchor_pos=5, n=3)
    assert torch.allclose(greedy, torch.sigmoid(torch.tensor(2.0)).expand(3))  # a = 0: the map alone decides
    _, sampled, _ = back.propose_sampled(ctx, anchor_id=3, anchor_pos=5, n=3, temperature=1.0,
                                         generator=torch.Generator().manual_seed(0))
    assert torch.allclose(sampled, torch.sigmoid(torch.tensor(-2.0)).expand(3))
    assert not torch.allclose(raw, greedy)
    assert load_draft(export_draft(T.tiny_model(), tmp_path / "plain")).confidence_calibration is None


def test_a_row_token_outside_the_draft_vocab_is_a_greedy_miss():
    """The draft cannot emit it, so greedy decoding rejects, whatever the argmax inside the draft vocab."""
    model = T.tiny_model().eval()
    vocab = {int(i) + int(model.d2t[i]) for i in range(T.D)}
    off = next(t for t in range(T.V) if t not in vocab)
    row = T.packed_row()
    row.input_ids_T[:] = off
    t2d = torch.zeros(T.V, dtype=torch.bool)
    t2d[torch.arange(T.D) + model.d2t] = True
    slots = held_out_slots(model, [row], VerifierHead(torch.randn(T.V, T.H), t2d))
    assert float(slots.greedy.sum()) == 0.0
    assert float(slots.reach["greedy"][slots.position > 1].sum()) == 0.0  # never past the first miss


def test_cross_fitting_scores_each_half_with_the_other_halfs_map():
    from hpc.calibration.fit import calibrated, concat_slots, cross_fitted_ece

    a, b = synthetic_slots(seed=1), synthetic_slots(seed=2)
    both = concat_slots([a, b])
    assert both.logit.numel() == a.logit.numel() + b.logit.numel()
    crossed = cross_fitted_ece(a, b)
    raw = ece_by_position(both, None, "greedy")
    # The distortion is the same in both halves, so a map fitted on one undoes it on the other.
    assert all(e > 0.1 for e, _ in raw) and all(e < 0.05 for e, _ in crossed["greedy"]), (raw, crossed)
    assert [w for _, w in crossed["greedy"]] == [w for _, w in raw]  # every slot scored once
    # A half scored by a map that is not its own: apply b's map to a by hand, position by position.
    cal_b = fit_calibration(b)
    by_hand = calibrated(a, cal_b, "greedy")
    at2 = a.position == 2
    assert torch.allclose(by_hand.logit[at2], cal_b.apply(a.logit[at2], "greedy", 2))


def test_the_weighted_floor_is_a_perfect_heads_ece_whatever_the_weights_scale():
    from hpc.calibration.fit import weighted_ece_floor
    from hpc.evaluate.confidence_report import ece_floor

    conf = torch.rand(200, generator=torch.Generator().manual_seed(0)) * 0.8 + 0.1
    ones = torch.ones(200)
    floor = weighted_ece_floor(conf, ones)
    assert floor == weighted_ece_floor(conf, 3 * ones)
    assert abs(floor - ece_floor(conf.tolist())) < 0.015  # the same null, drawn apart
    assert weighted_ece_floor(conf.repeat(10), torch.ones(2000)) < floor / 2  # more slots, less noise
    assert weighted_ece_floor(conf, torch.zeros(200)) == 0.0


def test_a_rows_context_kv_computed_once_gives_the_very_same_slots(monkeypatch):
    """Calibration drafts a row's anchors a chunk at a time and computes the context's K/V once
    for all chunks (at Kimi's 20k-token rows, ~40 chunks recomputed it ~40 times). Bit-identical
    to computing it in every chunk's forward."""
    model = T.tiny_model().eval()
    t2d = torch.zeros(T.V, dtype=torch.bool)
    t2d[torch.arange(T.D) + model.d2t] = True
    head = VerifierHead(torch.randn(T.V, T.H, generator=torch.Generator().manual_seed(4)), t2d)
    rows = [T.packed_row(), T.packed_row(seed=2)]
    computed = []
    real = type(model).context_kv
    monkeypatch.setattr(type(model), "context_kv", lambda self, *a: computed.append(1) or real(self, *a))
    with torch.no_grad():
        hoisted = held_out_slots(model, rows, head, max_anchors=4)
        assert len(computed) == len(rows)  # once per row, for its several chunks
        monkeypatch.setattr(type(model), "context_kv", lambda self, *a: None)  # each forward computes its own
        again = held_out_slots(model, rows, head, max_anchors=4)
    for name in ("logit", "greedy", "sampling", "position"):
        assert torch.equal(getattr(hoisted, name), getattr(again, name)), name
    assert all(torch.equal(hoisted.reach[k], again.reach[k]) for k in hoisted.reach)
