"""Draft-quality metrics that need no decoding: acceptance estimates and calibration.

Shapes: N blocks, B slots per block, D draft-vocab size, V target vocab.
"""

from __future__ import annotations

import torch


def accept_prob(p_draft_NBD: torch.Tensor, q_target_NBD: torch.Tensor) -> torch.Tensor:
    """sum_x min(p, q) = 1 - TV: the chance speculative sampling accepts the slot's draft."""
    return torch.minimum(p_draft_NBD, q_target_NBD).sum(-1)


def mean_acceptance(accept_NB: torch.Tensor, valid_NB: torch.Tensor) -> torch.Tensor:
    """Mean acceptance over supervised slots (numerator and count over the same slots)."""
    valid = valid_NB.to(accept_NB.dtype)
    return (accept_NB * valid).sum() / valid.sum().clamp_min(1)


def per_position_acceptance(accept_NB: torch.Tensor, valid_NB: torch.Tensor) -> torch.Tensor:
    """Mean acceptance per slot [B] over blocks where that slot is supervised."""
    valid = valid_NB.to(accept_NB.dtype)
    return (accept_NB * valid).sum(0) / valid.sum(0).clamp_min(1)


def expected_acceptance_length(accept_NB: torch.Tensor, valid_NB: torch.Tensor) -> torch.Tensor:
    """1 + sum_k prod_{j<=k} a_j, averaged over blocks.

    Slot k only counts if every earlier slot was accepted, hence the running product; the
    leading 1 is the verifier's bonus token, which makes the figure comparable to vLLM's
    `mean acceptance length = 1 + accepted / drafts`. Unsupervised slots end the chain.
    """
    chain_NB = torch.cumprod(accept_NB * valid_NB.to(accept_NB.dtype), dim=1)
    return 1.0 + chain_NB.sum(1).mean()


def greedy_acceptance(draft_logits_NBD: torch.Tensor, target_logits_NBD: torch.Tensor) -> torch.Tensor:
    """1.0 where the draft's argmax equals the target's argmax (what greedy decoding accepts)."""
    return (draft_logits_NBD.argmax(-1) == target_logits_NBD.argmax(-1)).float()


def mass_outside_draft_vocab(target_logits_TV: torch.Tensor, t2d_V: torch.Tensor) -> torch.Tensor:
    """Mean target probability on ids the draft cannot propose.

    Targets renormalised over the draft vocab overstate acceptance exactly by this mass, so it
    is logged beside every acceptance estimate.
    """
    logits_TV = target_logits_TV.float()
    lse_all_T = torch.logsumexp(logits_TV, -1)
    lse_kept_T = torch.logsumexp(logits_TV[:, t2d_V], -1)
    return (1.0 - torch.exp(lse_kept_T - lse_all_T)).mean()


def brier(confidence: torch.Tensor, outcome: torch.Tensor) -> torch.Tensor:
    return ((confidence.float() - outcome.float()) ** 2).mean()


def expected_calibration_error(confidence: torch.Tensor, outcome: torch.Tensor, bins: int = 10) -> torch.Tensor:
    """sum_b |B_b|/n * |mean(conf in b) - mean(outcome in b)| with equal-width bins on [0, 1]."""
    conf, out = confidence.float().flatten(), outcome.float().flatten()
    if conf.numel() == 0:
        return conf.new_zeros(())
    # Right-closed bins, with 0 going to the first: conf in (k/b, (k+1)/b].
    idx = (torch.ceil(conf * bins).long() - 1).clamp(0, bins - 1)
    # |B_b|/n * |mean conf - mean outcome| = |sum conf - sum outcome| / n per bin, so no bin's count
    # is read on the host: on the conf's device, with no sync, every training step.
    gap_b = conf.new_zeros(bins).index_add_(0, idx, conf - out)
    return gap_b.abs().sum() / conf.numel()
