"""The DSpark training objective on one packed row.

Per supervised slot k: `ce_w * CE(argmax target) + tv_w * TV + kl_w * KL(target || draft)`,
weighted by exp(-k / gamma) (k from 0) and normalised by the number of supervised slots; plus
`confidence_w * BCE(confidence, c*)` with the same weights, where c* is the event the served
decoding accepts on: the greedy match (draft argmax == target argmax) for greedy serving, or
1 - TV (speculative sampling's acceptance probability) for sampled serving. Targets are the frozen
verifier's own logits (hpc.model.teacher) over the draft vocab, from the captured last hidden state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hpc.formats.draft_args import ConfidenceTarget, LossArgs
from hpc.model import metrics as M
from hpc.model.blocks import check_attention, flex_attention_fn, make_blocks, select_anchors, tiled_sdpa_attention_fn
from hpc.model.dspark import DSparkDraft
from hpc.model.teacher import VerifierHead


def confidence_event(weights: LossArgs, accept_NB: torch.Tensor, logits_NBD: torch.Tensor,
                     target_logits_NBD: torch.Tensor) -> torch.Tensor:
    """What the confidence head is trained on and scored against (detached)."""
    if weights.confidence_target == ConfidenceTarget.sampling:
        return accept_NB.detach()
    return M.greedy_acceptance(logits_NBD.detach(), target_logits_NBD)


@dataclass
class PackedRow:
    """One row of captured verifier states; several documents may be packed in it."""

    input_ids_T: torch.Tensor
    loss_mask_T: torch.Tensor
    aux_TnH: torch.Tensor  # [T, n_aux, H_target]
    last_hidden_TH: torch.Tensor  # [T, H_target], post- or pre-norm per the capture
    doc_ids_T: torch.Tensor | None = None
    position_ids_T: torch.Tensor | None = None

    def __post_init__(self):
        T = self.input_ids_T.numel()
        if self.doc_ids_T is None:
            self.doc_ids_T = torch.zeros(T, dtype=torch.long, device=self.input_ids_T.device)
        if self.position_ids_T is None:
            self.position_ids_T = torch.arange(T, device=self.input_ids_T.device)

    def to(self, device: torch.device | str) -> PackedRow:
        """This row on `device` (the same row when it is there already)."""
        assert self.doc_ids_T is not None and self.position_ids_T is not None  # __post_init__ fills them
        return PackedRow(self.input_ids_T.to(device), self.loss_mask_T.to(device), self.aux_TnH.to(device),
                         self.last_hidden_TH.to(device), self.doc_ids_T.to(device), self.position_ids_T.to(device))


def slot_decay(block_size: int, gamma: float, sample_from_anchor: bool, device=None) -> torch.Tensor:
    """exp(-k/gamma) from the first predicting slot (slot 1 in DFlash layout, whose slot 0 is the bonus)."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    if not sample_from_anchor:
        k = (k - 1).clamp(min=0)
    return torch.exp(-k / gamma)


def objective(
    logits_NBD: torch.Tensor, target_logits_NBD: torch.Tensor, valid_NB: torch.Tensor,
    conf_logits_NB: torch.Tensor | None, weights: LossArgs, sample_from_anchor: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """(total loss, unweighted parts, per-slot acceptance 1 - TV) for N blocks of B slots."""
    B = logits_NBD.shape[1]
    logp_NBD = F.log_softmax(logits_NBD.float(), -1)
    logq_NBD = F.log_softmax(target_logits_NBD.float(), -1)
    p_NBD, q_NBD = logp_NBD.exp(), logq_NBD.exp()
    mask_NB = valid_NB.float()
    decay_B = slot_decay(B, weights.decay_gamma, sample_from_anchor, device=mask_NB.device)
    denom = mask_NB.sum() + 1e-5

    def reduce(per_slot_NB: torch.Tensor) -> torch.Tensor:
        return (per_slot_NB * mask_NB * decay_B).sum() / denom

    accept_NB = M.accept_prob(p_NBD, q_NBD)
    ce_NB = -logp_NBD.gather(-1, logq_NBD.argmax(-1, keepdim=True)).squeeze(-1)  # hard label: target argmax
    kl_NB = (q_NBD * (logq_NBD - logp_NBD)).sum(-1)
    parts = {"ce": reduce(ce_NB), "tv": reduce(1.0 - accept_NB), "kl": reduce(kl_NB)}
    loss = weights.ce_weight * parts["ce"] + weights.tv_weight * parts["tv"] + weights.kl_weight * parts["kl"]
    if conf_logits_NB is not None:
        event_NB = confidence_event(weights, accept_NB, logits_NBD, target_logits_NBD)
        bce_NB = F.binary_cross_entropy_with_logits(conf_logits_NB.float(), event_NB, reduction="none")
        parts["confidence"] = reduce(bce_NB)
        loss = loss + weights.confidence_weight * parts["confidence"]
    return loss, parts, accept_NB


@dataclass
class BlockOutputs:
    """The draft's and the target's view of N teacher-forced blocks of B slots."""

    logits_NBD: torch.Tensor
    target_logits_NBD: torch.Tensor
    conf_NB: torch.Tensor | None
    valid_NB: torch.Tensor
    target_idx_NB: torch.Tensor  # the row position each slot's target state comes from


def block_outputs(
    model: DSparkDraft, row: PackedRow, head: VerifierHead, max_anchors: int,
    generator: torch.Generator | None = None, attention: str = "auto", anchors_N: torch.Tensor | None = None,
    detach_confidence: bool = False, ctx_TH: torch.Tensor | None = None,
    ctx_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> BlockOutputs | None:
    """Blocks at anchors drawn from the row's loss mask, through the draft; None if none fit.
    `ctx_TH`, the row's projected context, and `ctx_kv`, its K/V per layer, save computing them
    again per call (calibration drafts a row's anchors a chunk at a time)."""
    a = model.args
    B = a.block_size
    if anchors_N is None:
        anchors_N = select_anchors(row.loss_mask_T, B, max_anchors, generator).to(row.input_ids_T.device)
    if anchors_N.numel() == 0:
        return None
    doc_ids_T, position_ids_T = row.doc_ids_T, row.position_ids_T
    assert doc_ids_T is not None and position_ids_T is not None  # PackedRow.__post_init__ fills them
    blocks = make_blocks(row.input_ids_T, row.loss_mask_T, position_ids_T, doc_ids_T, anchors_N, B,
                         a.mask_token_id, a.sample_from_anchor)
    if ctx_TH is None:
        ctx_TH = model.project_context(row.aux_TnH)
    if check_attention(attention, ctx_TH.device) == "flex":
        attend = flex_attention_fn(anchors_N, doc_ids_T, B)
    else:
        attend = tiled_sdpa_attention_fn(anchors_N, doc_ids_T, B)
    h_QH = model.backbone(ctx_TH, position_ids_T, blocks.block_ids_NB.flatten(), blocks.block_pos_NB.flatten(),
                          attend, ctx_kv)
    logits_QD, conf_Q = model.heads(h_QH, blocks.prev_ids_NB.flatten(), detach_confidence)
    with torch.no_grad():
        target_logits_QD = head(row.last_hidden_TH[blocks.target_idx_NB.flatten()]).float()
    N = anchors_N.numel()
    return BlockOutputs(logits_QD.view(N, B, -1), target_logits_QD.view(N, B, -1),
                        conf_Q.view(N, B) if conf_Q is not None else None, blocks.valid_NB, blocks.target_idx_NB)


def _empty_loss(model: DSparkDraft, head: VerifierHead) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A zero loss that reaches every trainable parameter: DDP (no find_unused_parameters) waits
    for each bucket's gradient, so a rank whose loss touched fewer parameters hung every rank. The
    metrics carry the keys a row with anchors gives, at zero slots: the ranks all-reduce them by key."""
    params = [p for p in model.parameters() if p.requires_grad]
    zero = torch.stack([p.sum() for p in params]).sum() * 0.0
    nil = zero.detach()
    first = 0 if model.args.sample_from_anchor else 1
    keys = ["loss", "loss_ce", "loss_tv", "loss_kl", "accept_rate", "accept_len", "greedy_accept_len", "supervised_slots"]
    if model.confidence_head is not None:
        keys += ["loss_confidence", "confidence_ece", "confidence_brier"]
    if head.full_VH is not None:
        keys.append("target_mass_outside_vocab")
    out = {k: nil.clone() for k in keys}
    out["per_position_accept"] = nil.new_zeros(model.args.block_size - first)
    return zero, out


def dspark_loss(
    model: DSparkDraft, row: PackedRow, head: VerifierHead, weights: LossArgs, max_anchors: int,
    generator: torch.Generator | None = None, attention: str = "auto", anchors_N: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    a = model.args
    out_b = block_outputs(model, row, head, max_anchors, generator, attention, anchors_N, weights.confidence_detach)
    if out_b is None:  # no anchor fits the row (a short reply at its end)
        return _empty_loss(model, head)
    logits_NBD, target_NBD, conf_NB, valid_NB = out_b.logits_NBD, out_b.target_logits_NBD, out_b.conf_NB, out_b.valid_NB
    loss, parts, accept_NB = objective(logits_NBD, target_NBD, valid_NB, conf_NB, weights, a.sample_from_anchor)
    mask_NB = valid_NB.float()
    out: dict[str, torch.Tensor] = {}
    if conf_NB is not None:
        sel = valid_NB
        conf_prob = torch.sigmoid(conf_NB.detach().float())[sel]
        # Scored against the event it is trained on, so the figure means what the name says.
        event = confidence_event(weights, accept_NB, logits_NBD, target_NBD)[sel]
        out["confidence_ece"] = M.expected_calibration_error(conf_prob, event)
        out["confidence_brier"] = M.brier(conf_prob, event)

    with torch.no_grad():
        # In the DFlash layout slot 0 is the bonus token, not a draft: leave it out of the chain.
        first = 0 if a.sample_from_anchor else 1
        accept, mask_NB = accept_NB.detach()[:, first:], mask_NB[:, first:]
        out.update({f"loss_{k}": v.detach() for k, v in parts.items()})
        out["loss"] = loss.detach()
        out["accept_rate"] = M.mean_acceptance(accept, mask_NB)  # over the drafted slots only
        out["accept_len"] = M.expected_acceptance_length(accept, mask_NB)
        greedy_NB = M.greedy_acceptance(logits_NBD, target_NBD)[:, first:]
        out["greedy_accept_len"] = M.expected_acceptance_length(greedy_NB, mask_NB)
        out["per_position_accept"] = M.per_position_acceptance(accept, mask_NB)
        out["supervised_slots"] = mask_NB.sum()
        if head.full_VH is not None:
            sample = out_b.target_idx_NB.flatten()[valid_NB.flatten()][:256]
            out["target_mass_outside_vocab"] = M.mass_outside_draft_vocab(
                head.full_logits(row.last_hidden_TH[sample]), head.t2d_V)
    return loss, out
