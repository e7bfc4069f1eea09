"""Calibration weighs held-out slots as decoding reads them: the anchors it drafts at, and no slot
past a response's end."""

from __future__ import annotations

import pytest
import torch

from hpc.calibration.fit import decode_visits, held_out_slots, response_segments
from hpc.evaluate.confidence_report import reached
from hpc.evaluate.reference import speculative_generate
from hpc.model.loss import PackedRow, VerifierHead
from tests.evaluate.test_reference import random_draft, random_target


def test_response_segments_number_each_run_of_response_tokens_per_document():
    mask = torch.tensor([0, 1, 1, 0, 1, 1, 1, 1])
    doc = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1])
    assert response_segments(mask, doc).tolist() == [-1, 0, 0, -1, 1, 1, 2, 2]


def test_greedy_visits_follow_the_one_path_decoding_takes():
    anchors = torch.arange(2, 9)  # one response at 2..9 (9 is the row's last token: no anchor)
    seg = response_segments(torch.tensor([0, 0] + [1] * 8), None)
    acc = torch.ones(7, 3)
    acc[0] = torch.tensor([1.0, 1.0, 0.0])  # anchor 2 accepts 2 drafts: the next block is at 5
    # anchor 5 accepts all 3: the next would be at 9, which has nothing left to draft
    assert decode_visits(acc, anchors, seg, 3).tolist() == [1, 0, 0, 1, 0, 0, 0]
    assert decode_visits(acc, anchors, seg, 1).tolist() == [1, 0, 1, 0, 1, 0, 1]  # n=1: every other one


def test_sampling_visits_are_the_chance_of_each_hand_over():
    anchors = torch.arange(2, 9)
    seg = response_segments(torch.tensor([0, 0] + [1] * 8), None)
    acc = torch.zeros(7, 3)
    acc[0] = 0.5  # from 2: to 3 w.p. 0.5, to 4 w.p. 0.25, to 5 and to 6 w.p. 0.125 each
    got = decode_visits(acc, anchors, seg, 3)  # later blocks accept nothing: all mass steps on by one
    assert got.tolist() == pytest.approx([1.0, 0.5, 0.75, 0.875, 1.0, 1.0, 1.0])


def test_a_decode_never_crosses_into_the_next_response():
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 1, 1, 1])  # two assistant turns in one document
    seg = response_segments(mask, None)
    anchors = torch.tensor([1, 2, 3, 5, 6, 7])
    acc = torch.ones(6, 3)  # every draft accepted: a jump of 4 from 1 would land on 5
    assert decode_visits(acc, anchors, seg, 3).tolist() == [1, 0, 0, 1, 0, 0]


def _captured_row(target, aux: list[int], prompt: list[int], out: list[int]) -> PackedRow:
    ids = torch.tensor([prompt + out])
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
    mask = torch.tensor([0] * len(prompt) + [1] * len(out))
    return PackedRow(ids[0], mask, torch.stack([hs[i][0] for i in aux], 1), hs[-1][0])


@pytest.fixture(scope="module")
def fitted():
    """A draft fitted to the target's greedy answer for a few steps, so that blocks accept runs of
    drafts (a random draft accepts almost none, and every anchor is then visited)."""
    from hpc.evaluate.reference import greedy_generate
    from hpc.formats.draft_args import LossArgs
    from hpc.model.loss import dspark_loss

    target, aux, prompt = random_target(), [1, 2, 3], [5, 17, 33, 2]
    row = _captured_row(target, aux, prompt, greedy_generate(target, prompt, 40))
    head = VerifierHead(target.lm_head.weight.detach(), torch.ones(target.config.vocab_size, dtype=torch.bool))
    draft = random_draft(target, aux).train()
    opt = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    for step in range(60):
        loss, _ = dspark_loss(draft, row, head, LossArgs(), 512, torch.Generator().manual_seed(step))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return target, aux, prompt, draft.eval(), head


def test_weighted_slots_are_exactly_the_ones_greedy_decoding_reads(fitted):
    """Teacher-forced over the target's greedy answer, weighed by visits at n, the held-out slots
    are the reference engine's calibration record: same count and same hits at every position.
    Exact at n = block_size only: the block's slots attend to each other, so a block drafted
    n < block_size wide computes other hidden states than training's (noted in the module)."""
    target, aux, prompt, draft, head = fitted
    n = draft.args.block_size
    record: list = []
    out, _ = speculative_generate(target, draft, prompt, 40, n, record=record)
    slots = held_out_slots(draft, [_captured_row(target, aux, prompt, out)], head, ns=[n])
    w = slots.reach["greedy"]
    assert set(w.unique().tolist()) <= {0.0, 1.0}
    for k in range(1, n + 1):
        at = (slots.position == k) & (w > 0)
        read = [m for _, m in reached(record, k)]
        assert (int(at.sum()), int(slots.greedy[at].sum())) == (len(read), sum(read)), f"position {k}"
    assert len(reached(record, 4)) > 0  # runs of acceptances: later positions were judged
    every = held_out_slots(draft, [_captured_row(target, aux, prompt, out)], head)
    assert float(every.reach["greedy"][every.position == 1].sum()) > float(w[slots.position == 1].sum())


def test_a_slot_weighs_only_for_the_n_that_draft_it(fitted):
    """With ns=[3, 7], positions 4-7 weigh only by n=7's visits: n=3 never drafts them."""
    from hpc.calibration.fit import response_segments as segs

    target, aux, prompt, draft, head = fitted
    out, _ = speculative_generate(target, draft, prompt, 40, 8)
    row = _captured_row(target, aux, prompt, out)
    both = held_out_slots(draft, [row], head, ns=[3, 7])
    seven = held_out_slots(draft, [row], head, ns=[7])
    three = held_out_slots(draft, [row], head, ns=[3])
    late = both.position > 3
    assert torch.equal(both.reach["greedy"][late], seven.reach["greedy"][late] / 2)
    assert float(three.reach["greedy"][late].sum()) == 0.0
    early = ~late
    assert torch.equal(both.reach["greedy"][early], (three.reach["greedy"][early] + seven.reach["greedy"][early]) / 2)
    assert float(seven.reach["greedy"][both.position == 8].sum()) == 0.0
    assert segs(row.loss_mask_T, row.doc_ids_T).max() == 0  # one response


def test_an_n_no_block_can_draft_is_refused(fitted):
    target, aux, prompt, draft, head = fitted
    row = _captured_row(target, aux, prompt, [7, 8, 9, 10])
    for ns in ([0, 3], [draft.args.block_size + 1]):
        with pytest.raises(ValueError, match="each n must be 1"):
            held_out_slots(draft, [row], head, ns=ns)
