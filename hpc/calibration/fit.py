"""Post-hoc calibration of the confidence head, per decoding mode and draft position.

The head is trained on one event (`train.loss.confidence_target`), while serving runs in one of
two modes: greedy decoding accepts a draft when it equals the target's argmax, speculative
sampling with probability 1 - TV. Whatever the head was trained on, a map per position, fitted
on held-out captures against each mode's event, makes its output the chance that mode accepts:
Platt's sigmoid(a_k * z + b_k), or an isotonic map (`hpc.formats.calibration`) where that predicts
held-out rows better. It is stored beside the export (`confidence_calibration.json`, which vLLM
does not read) and applied by whoever reads the confidences.

The held-out slots are weighed as decoding reaches them, because a position's confidence is
only ever read after every earlier draft in the block was accepted: greedy counts a slot when
all earlier drafted slots matched; sampling weighs it by the product of the earlier 1 - TV.
The greedy event is read off the row (the draft's token is the row's next one), which is the
target's greedy choice on regenerated data: fit on rows regenerated at temperature 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hpc.calibration.isotonic import fit_isotonic
from hpc.formats.calibration import MODES, Calibration, isotonic_chance
from hpc.model import metrics as M
from hpc.model.blocks import select_anchors
from hpc.model.dspark import DSparkDraft

# A position with fewer (effective) held-out slots than this shares the pooled map: a two-parameter
# fit on a handful of events is noise.
MIN_WEIGHT = 30.0


@dataclass
class HeldOutSlots:
    """Drafted slots of held-out blocks: confidence logit, both events, position, reach weights."""

    logit: torch.Tensor  # [S]
    greedy: torch.Tensor  # [S] 0/1
    sampling: torch.Tensor  # [S] 1 - TV
    position: torch.Tensor  # [S] from 1
    reach: dict[str, torch.Tensor]  # mode -> [S] weight: does decoding read this slot's confidence?
    block: torch.Tensor | None = None  # [S] the block each slot was drafted in (hpc.calibration.fold)


@torch.no_grad()
def held_out_slots(model: DSparkDraft, rows: Iterable, head, max_anchors: int = 512,
                   ns: Sequence[int] = ()) -> HeldOutSlots:
    """Teacher-forced blocks over held-out PackedRows at every anchor, `max_anchors` blocks per
    forward, up to the row's end: a completion's last B positions, which training leaves out,
    are drafted in decoding like any others (on the toy target's short replies they are 30% of
    the slots at position 1).

    With `ns`, the n decoding runs at, each slot also weighs by the chance that decoding at n
    drafts a block at its anchor (`decode_visits`) and reads that slot (its first n), averaged
    over ns. Decoding does not draft at
    every anchor: after k accepted drafts its next block starts k + 1 tokens on, so the anchors
    inside an easy run are skipped and those after a miss are not. On the toy target, slots at
    position 3 were accepted 0.55 of the time over every anchor of the benchmarks' answers and
    0.43 over the anchors decoding drafted at. The weights are exact for greedy decoding at
    n = block_size (less one without sample_from_anchor); a narrower block's slots attend to
    fewer mask slots, so its drafts differ a little from these teacher-forced ones."""
    from hpc.model.loss import block_outputs  # safetensors: loaded only on this path

    a = model.args
    first = 0 if a.sample_from_anchor else 1
    if ns and (min(ns) < 1 or max(ns) > a.max_n):
        raise ValueError(f"ns={list(ns)}: each n must be 1..{a.max_n}, the draft slots of its block")
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("z", "g", "s", "k", "rg", "rs", "b")}
    blocks_before = 0
    for row in rows:
        T = row.input_ids_T.numel()
        segment_T = response_segments(row.loss_mask_T, row.doc_ids_T)
        anchors = select_anchors(row.loss_mask_T, a.block_size, T, to_end=True).to(row.input_ids_T.device)
        blocks: dict[str, list[torch.Tensor]] = {k: [] for k in ("z", "g", "s", "v")}
        ctx_TH = model.project_context(row.aux_TnH)  # once per row, not per chunk, with its K/V
        ctx_kv = model.context_kv(ctx_TH, row.position_ids_T) if row.position_ids_T is not None else None
        for anchors_N in anchors.split(max_anchors):
            out = block_outputs(model, row, head, max_anchors, anchors_N=anchors_N, ctx_TH=ctx_TH, ctx_kv=ctx_kv)
            if out is None or out.conf_NB is None:
                break
            # A slot whose token is not its response's (past its end: decoding stopped) has no label.
            nxt_NB = out.target_idx_NB[:, first:] + 1
            inside = nxt_NB < T
            at = nxt_NB.clamp(max=T - 1)
            valid = out.valid_NB[:, first:] & inside & (segment_T[at] == segment_T[nxt_NB - 1]) & (segment_T[at] >= 0)
            logits, target = out.logits_NBD[:, first:], out.target_logits_NBD[:, first:]
            p, q = F.softmax(logits.float(), -1), F.softmax(target.float(), -1)
            # Greedy decoding accepts a draft when it is the target's argmax over the WHOLE vocab. On
            # regenerated rows (data.regen_temperature=0) that argmax is the row's next token, which
            # may lie outside the draft vocab: the draft then fails, while an argmax over the draft
            # vocab alone would call it a match. So the event is "the draft's token is the row's".
            g_NB = (model.draft_to_target(logits.argmax(-1)) == row.input_ids_T[at]).float()
            for key, t in (("z", out.conf_NB[:, first:].float()), ("g", g_NB), ("s", M.accept_prob(p, q)),
                           ("v", valid.float())):
                blocks[key].append(t)
        if not blocks["z"]:
            continue
        z, g_NB, s_NB, v = (torch.cat(blocks[k]) for k in ("z", "g", "s", "v"))
        # Slot k is read only after every earlier draft in the block was accepted.
        ones = torch.ones_like(g_NB[:, :1])
        reach_g = torch.cumprod(torch.cat([ones, (g_NB * v)[:, :-1]], 1), 1) * v
        reach_s = torch.cumprod(torch.cat([ones, (s_NB * v)[:, :-1]], 1), 1) * v
        if ns:
            # Decoding at n reads only a block's first n slots: at n=3 a block's slot 5 weighs nothing.
            col_B = torch.arange(g_NB.shape[1], device=g_NB.device)
            for r, acc in ((reach_g, g_NB * v), (reach_s, s_NB * v)):
                r *= torch.stack([decode_visits(acc, anchors, segment_T, n).to(r.dtype)[:, None] * (col_B < n)
                                  for n in ns]).mean(0)
        pos = torch.arange(1, g_NB.shape[1] + 1, device=g_NB.device).expand_as(g_NB)
        block = blocks_before + torch.arange(g_NB.shape[0], device=g_NB.device)[:, None].expand_as(g_NB)
        blocks_before += g_NB.shape[0]
        sel = v.bool()
        for key, t in (("z", z), ("g", g_NB), ("s", s_NB), ("k", pos), ("rg", reach_g), ("rs", reach_s),
                       ("b", block)):
            parts[key].append(t[sel])
    if not parts["z"]:
        raise ValueError("no held-out slots: the draft has no confidence head, or the rows have no loss mask")
    cat = {k: torch.cat(v) for k, v in parts.items()}
    return HeldOutSlots(cat["z"], cat["g"], cat["s"], cat["k"], {"greedy": cat["rg"], "sampling": cat["rs"]},
                        cat["b"])


def response_segments(loss_mask_T: torch.Tensor, doc_ids_T: torch.Tensor | None) -> torch.Tensor:
    """Per position, the index of the response (a run of loss-mask tokens inside one document)
    it belongs to, -1 outside every response: each response is one decode."""
    mask = loss_mask_T.bool()
    doc = doc_ids_T if doc_ids_T is not None else torch.zeros_like(loss_mask_T, dtype=torch.long)
    starts = mask.clone()
    starts[1:] &= ~mask[:-1] | (doc[1:] != doc[:-1])
    return torch.where(mask, torch.cumsum(starts.long(), 0) - 1, torch.full_like(doc, -1))


def decode_visits(accept_NB: torch.Tensor, anchors_N: torch.Tensor, segment_T: torch.Tensor, n: int) -> torch.Tensor:
    """[N] The chance that decoding at n drafts a block at each anchor of one row, when slot j of
    the block at anchor i is accepted with chance accept_NB[i, j] (0/1 for greedy, so the visits
    are too). Each response's decode starts at its first token; a block that accepts j of its n
    drafts hands over to the anchor j + 1 tokens on, within the same response. For sampling this
    assumes the decode stays on the row's tokens (rows regenerated at temperature 0): an
    approximation where sampling would have written other text."""
    pos = anchors_N.tolist()
    index = {t: i for i, t in enumerate(pos)}
    seg = segment_T.tolist()
    acc = accept_NB[:, :n].double().cpu().tolist()
    visit = [0.0] * len(pos)
    for i, t in enumerate(pos):
        if t == 0 or seg[t - 1] != seg[t]:
            visit[i] += 1.0
        here = visit[i]
        for j in range(n + 1):  # j drafts accepted, then a miss (or all n accepted)
            if here == 0.0:
                break
            stop = 1.0 - acc[i][j] if j < n else 1.0
            nxt = index.get(t + j + 1)
            if nxt is not None and seg[t + j + 1] == seg[t]:
                visit[nxt] += here * stop
            here *= acc[i][j] if j < n else 0.0
    return torch.tensor(visit, device=accept_NB.device)


def _fit(z: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> tuple[float, float]:
    """Weighted Platt scaling: argmin over (a, b) of the weighted BCE of sigmoid(a z + b) against y."""
    ab = torch.tensor([1.0, 0.0], dtype=torch.float64, requires_grad=True)
    z, y, w = z.double().cpu(), y.double().cpu(), w.double().cpu()  # two numbers: no device needed
    w = w / w.sum()
    opt = torch.optim.LBFGS([ab], lr=0.5, max_iter=200, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = (w * F.binary_cross_entropy_with_logits(ab[0] * z + ab[1], y, reduction="none")).sum()
        loss.backward()
        return loss

    opt.step(closure)
    a, b = (float(x) for x in ab.detach())
    return a, b


def _event(slots: HeldOutSlots, mode: str) -> torch.Tensor:
    return slots.greedy if mode == "greedy" else slots.sampling


def _log_loss(slots: HeldOutSlots, mode: str, ab: tuple[float, float], at: torch.Tensor) -> float:
    """Reach-weighted log loss (summed) of the map `ab` on the slots `at`."""
    a, b = ab
    z, y, w = slots.logit[at].double(), _event(slots, mode)[at].double(), slots.reach[mode][at].double()
    return float((w * F.binary_cross_entropy_with_logits(a * z + b, y, reduction="none")).sum())


def _pooled(slots: HeldOutSlots, mode: str) -> tuple[float, float]:
    """The one map fitted on every position's slots."""
    return _fit(slots.logit, _event(slots, mode), slots.reach[mode])


def fit_calibration(slots: HeldOutSlots, halves: tuple[HeldOutSlots, HeldOutSlots] | None = None,
                    share: dict[str, list[int]] | None = None,
                    isotonic_at: dict[str, list[int]] | None = None) -> Calibration:
    """A map per mode and position, or the pooled map where a position has too few slots. With
    the rows' two `halves`, a position also shares the pooled map when its own, fitted on one
    half, predicts the other half worse than the pooled one does: two parameters fitted on a
    few dozen reached slots mostly fit their noise (on the toy, 72 slots at position 4 read a
    cross-fitted ECE of 0.22 where the pooled map read 0.06 on the benchmarks). `share` names
    positions, per mode, that share the pooled map whatever their counts.

    A position with a map of its own also gets an isotonic map (`hpc.formats.calibration`), which
    replaces its Platt map where, fitted on one half, it predicts the other half better (both
    ways, summed); `isotonic_at` names positions, per mode, that get one without that test."""
    maps: dict[str, list[tuple[float, float]]] = {}
    pooled_at: dict[str, list[int]] = {}
    isotonic: dict[str, dict[int, tuple[list[float], list[float]]]] = {}
    for mode in MODES:
        event, w = _event(slots, mode), slots.reach[mode]
        pooled = _pooled(slots, mode)
        # Each half's pooled map, fitted once: every position's test scores against it.
        halves_pooled = None if halves is None else (_pooled(halves[0], mode), _pooled(halves[1], mode))
        per, shared, iso = [], [], {}
        for k in range(1, int(slots.position.max()) + 1):
            at = slots.position == k
            sparse = float(w[at].sum()) < MIN_WEIGHT or k in (share or {}).get(mode, ())
            # Each half's own map at k, fitted once for both tests below.
            own = None if sparse or halves is None else _half_maps(halves, mode, k)
            if sparse or (halves is not None and halves_pooled is not None
                          and (own is None or not _own_map_generalises(halves, halves_pooled, own, mode, k))):
                per.append(pooled)
                shared.append(k)
                continue
            per.append(_fit(slots.logit[at], event[at], w[at]))
            if (k in (isotonic_at or {}).get(mode, ())
                    or (halves is not None and own is not None and _isotonic_generalises(halves, own, mode, k))):
                iso[k] = fit_isotonic(slots.logit[at], event[at], w[at])
        maps[mode], pooled_at[mode], isotonic[mode] = per, shared, iso
    # Slots no decode reads (weight 0 in both modes) are not counted as fitted on.
    read = int(((slots.reach["greedy"] > 0) | (slots.reach["sampling"] > 0)).sum())
    return Calibration(maps, read, pooled_at, isotonic)


def _half_maps(halves: tuple[HeldOutSlots, HeldOutSlots], mode: str,
               k: int) -> tuple[tuple[float, float], tuple[float, float]] | None:
    """Position k's Platt map fitted on each half, in the halves' order; None where a half has
    too few slots to fit or the other half none to score it on (then k shares the pooled map)."""
    maps = []
    for fit_on, score_on in ((halves[0], halves[1]), (halves[1], halves[0])):
        at_fit, w = fit_on.position == k, fit_on.reach[mode]
        if float(w[at_fit].sum()) < MIN_WEIGHT or float(score_on.reach[mode][score_on.position == k].sum()) <= 0:
            return None
        maps.append(_fit(fit_on.logit[at_fit], _event(fit_on, mode)[at_fit], w[at_fit]))
    return maps[0], maps[1]


def _isotonic_generalises(halves: tuple[HeldOutSlots, HeldOutSlots],
                          own: tuple[tuple[float, float], tuple[float, float]], mode: str, k: int) -> bool:
    """Does position k's isotonic map, fitted on each half, predict the other half at k better
    than its Platt map fitted there (`own`, in the halves' order)? Judged by the reach-weighted
    squared error (Brier): the isotonic map says 0 or 1 at its ends, where a log loss would judge
    one miss as infinitely bad."""
    iso = platt = 0.0
    for (fit_on, score_on), (a, b) in zip(((halves[0], halves[1]), (halves[1], halves[0])), own):
        at_fit, at_score = fit_on.position == k, score_on.position == k
        z, y, w = fit_on.logit[at_fit], _event(fit_on, mode)[at_fit], fit_on.reach[mode][at_fit]
        zs = score_on.logit[at_score].double().cpu()
        ys, ws = _event(score_on, mode)[at_score].double().cpu(), score_on.reach[mode][at_score].double().cpu()
        iso += float((ws * (isotonic_chance(zs, fit_isotonic(z, y, w)) - ys) ** 2).sum())
        platt += float((ws * (torch.sigmoid(a * zs + b) - ys) ** 2).sum())
    return iso < platt


def _own_map_generalises(halves: tuple[HeldOutSlots, HeldOutSlots],
                         halves_pooled: tuple[tuple[float, float], tuple[float, float]],
                         own: tuple[tuple[float, float], tuple[float, float]], mode: str, k: int) -> bool:
    """Does position k's own map, fitted on each half (`own`), predict the other half at k better
    than that half's pooled map (`halves_pooled`) does? Both in the halves' order."""
    mine = pooled = 0.0
    for score_on, fit_own, fit_pooled in zip((halves[1], halves[0]), own, halves_pooled):
        at_score = score_on.position == k
        mine += _log_loss(score_on, mode, fit_own, at_score)
        pooled += _log_loss(score_on, mode, fit_pooled, at_score)
    return mine < pooled


def weighted_ece(conf: torch.Tensor, event: torch.Tensor, weight: torch.Tensor, bins: int = 10) -> float:
    """ECE with each slot weighed by how often decoding reaches it (equal-width bins)."""
    idx = (conf * bins).long().clamp(max=bins - 1)
    total = float(weight.sum())
    ece = 0.0
    for b in range(bins):
        at = idx == b
        wb = float(weight[at].sum())
        if wb > 0:
            ece += wb / total * abs(float((weight[at] * event[at]).sum()) / wb - float((weight[at] * conf[at]).sum()) / wb)
    return ece


def weighted_ece_floor(conf: torch.Tensor, weight: torch.Tensor, draws: int = 200, seed: int = 0) -> float:
    """The mean `weighted_ece` of a perfectly calibrated head (events drawn as Bernoulli(conf))
    on these slots and weights: ECE is biased upwards on few slots, so one near this floor is noise."""
    if conf.numel() == 0 or float(weight.sum()) <= 0:
        return 0.0
    gen = torch.Generator().manual_seed(seed)
    conf, weight = conf.double().cpu(), weight.double().cpu()
    return sum(weighted_ece(conf, (torch.rand(conf.shape, generator=gen, dtype=torch.float64) < conf).double(), weight)
               for _ in range(draws)) / draws


def ece_by_position(slots: HeldOutSlots, cal: Calibration | None, mode: str) -> list[tuple[float, float]]:
    """(ECE, effective count) per position of these slots, raw (cal None) or calibrated."""
    event = _event(slots, mode)
    out = []
    for k in range(1, int(slots.position.max()) + 1):
        at = slots.position == k
        z = slots.logit[at]
        if cal is not None:
            z = cal.apply(z, mode, k)
        w = slots.reach[mode][at]
        out.append((weighted_ece(torch.sigmoid(z), event[at], w) if float(w.sum()) > 0 else float("nan"),
                    float(w.sum())))
    return out


def concat_slots(parts: list[HeldOutSlots]) -> HeldOutSlots:
    block = None
    if parts and all(p.block is not None for p in parts):
        ids, before = [], 0
        for p in parts:  # each part numbers its blocks from 0: keep them apart
            assert p.block is not None
            ids.append(p.block + before)
            before += int(p.block.max()) + 1 if p.block.numel() else 0
        block = torch.cat(ids)
    return HeldOutSlots(torch.cat([p.logit for p in parts]), torch.cat([p.greedy for p in parts]),
                        torch.cat([p.sampling for p in parts]), torch.cat([p.position for p in parts]),
                        {m: torch.cat([p.reach[m] for p in parts]) for m in MODES}, block)


def calibrated(slots: HeldOutSlots, cal: Calibration, mode: str) -> HeldOutSlots:
    """The same slots with `cal`'s `mode` map applied to each slot's logit at its position."""
    z = slots.logit.clone()
    for k in range(1, int(slots.position.max()) + 1):
        at = slots.position == k
        z[at] = cal.apply(slots.logit[at], mode, k)
    return HeldOutSlots(z, slots.greedy, slots.sampling, slots.position, slots.reach, slots.block)


def cross_fitted_ece(a: HeldOutSlots, b: HeldOutSlots, pooled_at: dict[str, list[int]] | None = None,
                     isotonic_at: dict[str, list[int]] | None = None) -> dict[str, list[tuple[float, float]]]:
    """Per mode, (ECE, effective count) per position, each half scored by the map fitted on the
    other: what the map fitted on both will read on rows it has not seen, where an in-sample ECE
    would flatter it. `pooled_at` and `isotonic_at` (the fit on both halves' choices) give each
    half's map the same kind at each position."""
    return {mode: ece_by_position(crossed, None, mode)
            for mode, crossed in cross_fitted(a, b, pooled_at, isotonic_at).items()}


def cross_fitted(a: HeldOutSlots, b: HeldOutSlots, pooled_at: dict[str, list[int]] | None = None,
                 isotonic_at: dict[str, list[int]] | None = None) -> dict[str, HeldOutSlots]:
    """Per mode, both halves' slots, each calibrated by the map fitted on the other half."""
    cal_a = fit_calibration(a, share=pooled_at, isotonic_at=isotonic_at)
    cal_b = fit_calibration(b, share=pooled_at, isotonic_at=isotonic_at)
    return {mode: concat_slots([calibrated(a, cal_b, mode), calibrated(b, cal_a, mode)]) for mode in MODES}
