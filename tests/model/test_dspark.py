"""The draft model, its training blocks and its objective."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from enum import Enum

import pytest
import torch

from hpc.formats.draft_args import ConfidenceTarget, DraftArgs, LossArgs
from hpc.model.blocks import flex_attention_fn, make_blocks, select_anchors, training_mask
from hpc.model.dspark import DSparkDraft, sdpa_attention
from hpc.model.loss import PackedRow, VerifierHead, dspark_loss, objective
from tests.fixtures.draft import toy_draft_args

V, H, D = 64, 32, 48


def tiny_args(**kw) -> DraftArgs:
    base = dict(hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                intermediate_size=64, block_size=4, draft_vocab_size=D, mask_token_id=V - 1, markov_rank=8,
                target_hidden_size=H, target_vocab_size=V, aux_layer_ids=[1, 2, 3], rope_theta=10000.0)
    base.update(kw)
    return toy_draft_args(**base)


def tiny_model(seed: int = 0, **kw) -> DSparkDraft:
    torch.manual_seed(seed)
    model = DSparkDraft(tiny_args(**kw))
    for p in model.parameters():  # random heads, so nothing trivially cancels
        torch.nn.init.normal_(p, std=0.2) if p.dim() > 1 else torch.nn.init.normal_(p, 1.0, 0.1)
    model.d2t.copy_(torch.arange(D) * 0 + torch.arange(D) // 4)  # some pruned target ids
    return model


def packed_row(T: int = 24, docs: tuple[int, ...] = (10, 14), seed: int = 1) -> PackedRow:
    g = torch.Generator().manual_seed(seed)
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(docs)])
    pos = torch.cat([torch.arange(n) for n in docs])
    loss_mask = torch.ones(T, dtype=torch.long)
    loss_mask[[0, 1, 10, 11]] = 0  # each document opens with a prompt
    return PackedRow(torch.randint(0, V - 1, (T,), generator=g), loss_mask, torch.randn(T, 3, H, generator=g),
                     torch.randn(T, H, generator=g), doc_ids, pos)


def test_dflash_ablation_has_exactly_the_dflash_tensors():
    dflash = DSparkDraft(tiny_args(markov_rank=0, enable_confidence_head=False))
    dspark = DSparkDraft(tiny_args())
    assert dflash.args.is_dflash and not dspark.args.is_dflash
    extra = set(dspark.state_dict()) - set(dflash.state_dict())
    assert extra == {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
                     "confidence_head.proj.weight", "confidence_head.proj.bias"}
    assert dspark.state_dict()["confidence_head.proj.weight"].shape == (1, H + 8)
    no_markov_conf = DSparkDraft(tiny_args(confidence_head_with_markov=False))
    assert no_markov_conf.state_dict()["confidence_head.proj.weight"].shape == (1, H)
    assert not dspark.embed_tokens.weight.requires_grad


def test_anchors_are_sorted_seeded_and_inside_the_mask():
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1])
    a = select_anchors(mask, block_size=3, max_anchors=3, generator=torch.Generator().manual_seed(0))
    b = select_anchors(mask, block_size=3, max_anchors=3, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a, b) and a.tolist() == sorted(a.tolist()) and len(a) == 3
    assert all(mask[i] == 1 and i < 12 - 3 for i in a.tolist())
    assert select_anchors(mask, 3, 100).tolist() == [2, 3, 4, 6, 7, 8]


def test_block_layout_for_both_anchor_semantics():
    ids = torch.tensor([10, 11, 12, 13, 14, 15])
    mask = torch.tensor([0, 1, 1, 1, 1, 0])
    zeros, pos = torch.zeros(6, dtype=torch.long), torch.arange(6)
    b = make_blocks(ids, mask, pos, zeros, torch.tensor([1]), 3, 99, sample_from_anchor=True)
    assert b.block_ids_NB.tolist() == [[11, 99, 99]] and b.block_pos_NB.tolist() == [[1, 2, 3]]
    assert b.target_idx_NB.tolist() == [[1, 2, 3]]  # slot k predicts x_{p+k+1} from position p+k
    assert b.prev_ids_NB.tolist() == [[11, 12, 13]]
    assert b.valid_NB.tolist() == [[True, True, True]]
    f = make_blocks(ids, mask, pos, zeros, torch.tensor([2]), 3, 99, sample_from_anchor=False)
    assert f.target_idx_NB.tolist() == [[1, 2, 3]]  # slot 0 is the bonus; slot k predicts x_{p+k}
    assert f.prev_ids_NB.tolist() == [[11, 12, 13]]
    assert f.valid_NB.tolist() == [[False, True, True]]


@pytest.mark.parametrize("sample_from_anchor", [True, False])
def test_only_the_contiguous_prefix_is_supervised(sample_from_anchor):
    """A user turn shorter than the block left slots after it supervised: they predicted the next
    reply without the turn it answers."""
    ids = torch.arange(12)
    mask = torch.tensor([0, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1])  # reply, a 2-token user turn, reply
    zeros, pos = torch.zeros(12, dtype=torch.long), torch.arange(12)
    b = make_blocks(ids, mask, pos, zeros, torch.tensor([1]), 8, 99, sample_from_anchor)
    want = [True, True, True, False, False, False, False, False]  # targets 1, 2, 3; then the turn
    if not sample_from_anchor:
        want = [False, True, True, True, False, False, False, False]  # the bonus, then targets 1, 2, 3
    assert b.valid_NB.tolist() == [want]


def test_a_dflash_block_at_a_documents_first_token_keeps_its_slots():
    """Slot 0's target (the token before the anchor) is the previous document's: it is the bonus
    either way, and must not end the supervised prefix."""
    ids, mask = torch.arange(8), torch.ones(8, dtype=torch.long)
    docs, pos = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]), torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    b = make_blocks(ids, mask, pos, docs, torch.tensor([4]), 4, 99, sample_from_anchor=False)
    assert b.valid_NB.tolist() == [[False, True, True, True]]


def test_training_mask_by_hand():
    # Two documents [0,1,2 | 3,4]; anchors at 2 and 4; B = 2.
    m = training_mask(torch.tensor([2, 4]), torch.tensor([0, 0, 0, 1, 1]), 2).int().tolist()
    assert m == [
        [1, 1, 0, 0, 0, 1, 1, 0, 0],
        [1, 1, 0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 1, 0, 0, 0, 1, 1],
        [0, 0, 0, 1, 0, 0, 0, 1, 1],
    ]


@pytest.mark.parametrize("sample_from_anchor", [True, False])
def test_training_blocks_see_exactly_what_decoding_sees(sample_from_anchor):
    """Each block of a packed training forward equals drafting it alone after its context."""
    model = tiny_model(sample_from_anchor=sample_from_anchor).double()
    row = packed_row()
    row.aux_TnH, row.last_hidden_TH = row.aux_TnH.double(), row.last_hidden_TH.double()
    anchors = torch.tensor([3, 6, 12, 17])
    B = model.args.block_size
    ctx = model.project_context(row.aux_TnH)
    blocks = make_blocks(row.input_ids_T, row.loss_mask_T, row.position_ids_T, row.doc_ids_T, anchors, B,
                         model.args.mask_token_id, sample_from_anchor)
    h = model.backbone(ctx, row.position_ids_T, blocks.block_ids_NB.flatten(), blocks.block_pos_NB.flatten(),
                       sdpa_attention(training_mask(anchors, row.doc_ids_T, B))).view(4, B, -1)
    for j, p in enumerate(anchors.tolist()):
        start = int((row.doc_ids_T == row.doc_ids_T[p]).nonzero()[0])
        alone = model.block_hidden(model.project_context(row.aux_TnH[start:p]), int(row.input_ids_T[p]), p - start, B)
        torch.testing.assert_close(h[j], alone, rtol=1e-10, atol=1e-10)


def test_flex_and_sdpa_paths_agree():
    row = packed_row()
    anchors = torch.tensor([2, 5, 12, 15])
    B, nh, hd = 4, 2, 8
    g = torch.Generator().manual_seed(0)
    Q, K = 4 * B, row.input_ids_T.numel() + 4 * B
    q, k, v = (torch.randn(1, nh, n, hd, generator=g) for n in (Q, K, K))
    ref = sdpa_attention(training_mask(anchors, row.doc_ids_T, B))(q, k, v)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex_attention warns that it is unfused
        flex = flex_attention_fn(anchors, row.doc_ids_T, B)(q, k, v)
    torch.testing.assert_close(flex, ref, rtol=1e-5, atol=1e-5)


def test_objective_by_hand():
    # One block, B = 2, D = 2. Draft p = softmax(0, ln 3) = (1/4, 3/4); target q = (1/2, 1/2) at slot 0,
    # q = (1, 0)-ish at slot 1 via a large logit gap.
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
    target = torch.tensor([[[0.0, 0.0], [50.0, 0.0]]])
    valid = torch.tensor([[True, True]])
    w = LossArgs(ce_weight=0.1, tv_weight=0.9, kl_weight=0.0, decay_gamma=4.0, confidence_weight=1.0)
    conf = torch.tensor([[0.0, 0.0]])
    loss, parts, accept = objective(logits, target, valid, conf, w)
    # accept = sum min(p, q): slot0 = 1/4 + 1/2 = 3/4 ; slot1 = 1/4
    torch.testing.assert_close(accept, torch.tensor([[0.75, 0.25]]))
    d1 = math.exp(-1 / 4.0)
    # tv = 1 - accept, decayed (1, e^{-1/4}), normalised by 2 supervised slots
    assert parts["tv"].item() == pytest.approx((0.25 + 0.75 * d1) / 2, rel=1e-5)
    # CE against target argmax: slot0 argmax is id 0 (tie -> first), slot1 id 0: -ln(1/4) both
    assert parts["ce"].item() == pytest.approx(math.log(4) * (1 + d1) / 2, rel=1e-5)
    # BCE(logit 0, c*) = ln 2 for any c*
    assert parts["confidence"].item() == pytest.approx(math.log(2) * (1 + d1) / 2, rel=1e-5)
    assert loss.item() == pytest.approx(0.1 * parts["ce"].item() + 0.9 * parts["tv"].item()
                                        + parts["confidence"].item(), rel=1e-6)


def test_loss_backward_and_metrics_on_a_packed_row():
    model = tiny_model()
    row = packed_row()
    lm_head = torch.randn(V, H)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.arange(D) + model.d2t] = True
    head = VerifierHead(lm_head, t2d, keep_full=True)
    loss, m = dspark_loss(model, row, head, LossArgs(), max_anchors=5, generator=torch.Generator().manual_seed(0),
                          attention="sdpa")
    loss.backward()
    assert torch.isfinite(loss) and model.fc.weight.grad is not None
    assert model.embed_tokens.weight.grad is None
    assert model.markov_head.markov_w1.weight.grad is not None
    assert 1.0 <= m["accept_len"].item() <= 1 + model.args.block_size
    assert m["per_position_accept"].shape == (model.args.block_size,)
    assert 0.0 < m["target_mass_outside_vocab"].item() < 1.0


@pytest.mark.parametrize("sample_from_anchor", [True, False])
def test_accept_rate_of_a_constant_acceptance_is_that_constant(monkeypatch, sample_from_anchor):
    # The DFlash layout drops slot 0 (the bonus) from the chain: the mean must drop it from the
    # count too. (make_blocks marks that slot unsupervised today, so the old sliced-sum over
    # full-count mean agreed by luck; this pins the figure whatever the mask does.)
    import hpc.model.loss as loss_mod

    monkeypatch.setattr(loss_mod.M, "accept_prob", lambda p, q: torch.full(p.shape[:-1], 0.5))
    model = tiny_model(sample_from_anchor=sample_from_anchor)
    lm_head = torch.randn(V, H)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.arange(D) + model.d2t] = True
    _, m = dspark_loss(model, packed_row(), VerifierHead(lm_head, t2d), LossArgs(), max_anchors=5,
                       generator=torch.Generator().manual_seed(0), attention="sdpa")
    assert m["accept_rate"].item() == pytest.approx(0.5)


@pytest.mark.parametrize("event", ["greedy", "sampling"])
def test_confidence_is_trained_on_the_event_decoding_accepts_on(event):
    # Same block as test_objective_by_hand: the draft's argmax (id 1) misses the target's (id 0)
    # at both slots, while 1 - TV is 3/4 and 1/4. BCE(logit x, c) = ln(1 + e^x) - c * x.
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
    target = torch.tensor([[[0.0, 0.0], [50.0, 0.0]]])
    conf = torch.full((1, 2), math.log(3.0))
    w = LossArgs(decay_gamma=4.0, confidence_target=ConfidenceTarget(event))
    _, parts, _ = objective(logits, target, torch.tensor([[True, True]]), conf, w)
    c = [0.0, 0.0] if event == "greedy" else [0.75, 0.25]
    d1 = math.exp(-1 / 4.0)
    bce = [math.log(4.0) - ci * math.log(3.0) for ci in c]
    assert parts["confidence"].item() == pytest.approx((bce[0] + bce[1] * d1) / 2, rel=1e-5)


def _distinct(cls) -> dict:
    """A value for every field of the dataclass `cls`: none its default, no two alike."""
    out: dict = {}
    for i, f in enumerate(dataclasses.fields(cls)):
        d = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        if isinstance(d, Enum):
            out[f.name] = next(m for m in type(d) if m != d)
        elif isinstance(d, bool):
            out[f.name] = not d
        elif isinstance(d, (int, float)):
            out[f.name] = type(d)(1000 + i)
        elif isinstance(d, list):
            out[f.name] = [1000 + i, 2000 + i]
        else:
            out[f.name] = f"value-{i}"
    return out


def test_the_config_sections_are_the_model_classes():
    """One class per concept: what `draft:` and `train.loss:` load is what the model and the
    objective take, with the target's dims following verifier.*."""
    from hpc.config.load import load_config, to_object

    cfg = to_object(load_config("configs/kimi-k2.6-dspark.yaml", [
        "verifier.hidden_size=96", "verifier.vocab_size=4096", "verifier.aux_layer_ids=[1,3]",
        "train.loss.ce_weight=0.25", "train.loss.confidence_target=greedy"]))
    assert type(cfg.draft) is DraftArgs and type(cfg.train.loss) is LossArgs
    assert (cfg.draft.hidden_size, cfg.draft.target_hidden_size, cfg.draft.target_vocab_size,
            cfg.draft.aux_layer_ids) == (96, 96, 4096, [1, 3])
    assert cfg.train.loss == LossArgs(ce_weight=0.25, confidence_target=ConfidenceTarget.greedy)


@pytest.mark.parametrize("dflash", [False, True])
def test_config_json_carries_every_draft_key_and_reads_back_the_same(dflash):
    args = DraftArgs(**_distinct(DraftArgs))
    if dflash:  # DFlash's own layout: no Markov or confidence head, slot 0 the bonus
        args = dataclasses.replace(args, markov_rank=0, enable_confidence_head=False, sample_from_anchor=False,
                                   markov_head_type="vanilla", confidence_head_with_markov=True)
    back = DraftArgs.from_config_json(json.loads(json.dumps(args.to_config_json("acme/target", ["X"], 1))))
    assert back == args

    @dataclasses.dataclass
    class _Draft(DraftArgs):
        new_knob: int = 0

    grown = _Draft(**_distinct(_Draft))  # the check sees a key config.json does not carry
    assert grown.new_knob != 0 and not hasattr(DraftArgs.from_config_json(grown.to_config_json(None, [], 1)),
                                               "new_knob")


@pytest.mark.parametrize("detach", [False, True])
def test_a_detached_confidence_loss_trains_its_head_and_nothing_else(detach):
    model = tiny_model()
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.arange(D) + model.d2t] = True
    head = VerifierHead(torch.randn(V, H), t2d)
    only_confidence = LossArgs(ce_weight=0.0, tv_weight=0.0, kl_weight=0.0, confidence_weight=1.0,
                               confidence_detach=detach)
    loss, _ = dspark_loss(model, packed_row(), head, only_confidence, max_anchors=5,
                          generator=torch.Generator().manual_seed(0), attention="sdpa")
    loss.backward()
    assert model.confidence_head.proj.weight.grad.abs().sum() > 0
    backbone = [model.fc.weight.grad, model.markov_head.markov_w1.weight.grad]
    reached = any(g is not None and g.abs().sum() > 0 for g in backbone)
    assert reached is not detach


@pytest.mark.parametrize("kw", [{}, {"markov_rank": 0, "enable_confidence_head": False, "sample_from_anchor": False}])
@pytest.mark.parametrize("keep_full", [True, False])
def test_a_row_with_no_anchor_reports_the_same_metrics_and_reaches_every_parameter(kw, keep_full):
    """Ranks all-reduce the metrics by key, and DDP waits for every parameter's gradient: a row no
    anchor fits (a short reply at its end) must give both, or every rank hangs."""
    model = tiny_model(**kw)
    lm_head = torch.randn(V, H)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.arange(D) + model.d2t] = True
    head = VerifierHead(lm_head, t2d, keep_full=keep_full)
    _, full = dspark_loss(model, packed_row(), head, LossArgs(), max_anchors=5,
                          generator=torch.Generator().manual_seed(0), attention="sdpa")
    row = packed_row()
    row.loss_mask_T.zero_()
    row.loss_mask_T[-3:] = 1  # three reply tokens at the row's end: no block fits
    loss, empty = dspark_loss(model, row, head, LossArgs(), max_anchors=5, attention="sdpa")
    assert set(empty) == set(full)
    assert {k: v.shape for k, v in empty.items()} == {k: v.shape for k, v in full.items()}
    assert empty["supervised_slots"].item() == 0 and loss.item() == 0.0
    loss.backward()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(p.grad is not None for n, p in model.named_parameters() if n in trainable)
