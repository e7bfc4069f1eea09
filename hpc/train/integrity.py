"""Is a capture the target's own states for its own tokens? Checked on every sample a trainer takes.

vLLM's hidden-state path has failed before with states from the wrong slots or all zeros. The
shapes and token ids still match, so a run trains on them to near-zero acceptance without a
word. Two checks catch that class, cheaply enough to stay on:

- the states themselves: any NaN or infinity, a captured layer that is all zeros, or one that is
  the same vector at every position;
- the teacher: on rows the target generated greedily (regenerated at temperature 0), the target's
  own argmax from the captured last hidden state at position t is the row's token t + 1. The
  share that agrees, over up to `MAX_POSITIONS` assistant positions per sample (evenly spaced:
  no random draw, so training's generator and its losses stay as they were), must reach
  `train.min_teacher_agreement`. States from one slot off agree with the token one further
  (or one nearer) instead, which names the fault. A share is judged only past `MIN_POSITIONS`.

Rows a person wrote are not the target's argmax; there the share is logged, never enforced.
"""

from __future__ import annotations

import torch

from hpc.errors import UserError
from hpc.model.teacher import VerifierHead
from hpc.stream.sample import Capture

MAX_POSITIONS = 256  # per sample: one [256, draft_vocab] matmul, nothing beside the step's own
MIN_POSITIONS = 16  # fewer and one near-tie decides the share: counted, not judged
SHIFTS = (-1, 1)  # captured[t] holding the state of t - 1 or t + 1


def state_problem(cap: Capture) -> str | None:
    """What is wrong with the captured states as numbers, or None."""
    layers = [("last hidden", cap.last_hidden_TH)] + [
        (f"aux layer {i}", cap.aux_TnH[:, i]) for i in range(cap.aux_TnH.shape[1])]
    for name, x_TH in layers:
        if not bool(torch.isfinite(x_TH).all()):
            return f"its {name} states hold NaN or infinity"
        if not bool(x_TH.any()):
            return f"its {name} states are all zero"
        if x_TH.shape[0] > 1 and bool((x_TH == x_TH[:1]).all()):
            return f"its {name} states are the same vector at every position"
    return None


class TeacherAgreement:
    """Per sample: (positions agreeing at the true slot, positions checked); raises on a fault."""

    def __init__(self, head: VerifierHead, min_share: float, enforce: bool):
        self.head, self.min_share, self.enforce = head, min_share, enforce
        t2d = head.t2d_V.bool()
        # target id -> its row in the draft vocab, -1 off it (such a token's argmax is not in view)
        self.draft_index_V = torch.where(t2d, torch.cumsum(t2d.long(), 0) - 1, -1)

    def __call__(self, cap: Capture, origin: str = "") -> tuple[int, int]:
        where = f"sample {cap.sample_id}" + (f" from {origin}" if origin else "")
        if (why := state_problem(cap)) is not None:
            raise UserError(f"capture of {where}: {why}; the verifier's hidden-state capture is broken "
                            "(check verifier.backend, verifier.aux_layer_ids and that node's vLLM log)")
        ids_T = cap.input_ids_T.to(self.draft_index_V.device).long()
        T = ids_T.numel()
        mask_T = cap.loss_mask_T.to(ids_T.device).bool()
        # position t predicts t + 1: looked at where t + 1 is a trained (assistant) token
        pos = torch.arange(T - 1, device=ids_T.device)[mask_T[1:]]
        if pos.numel() > MAX_POSITIONS:
            pos = pos[torch.linspace(0, pos.numel() - 1, MAX_POSITIONS, device=pos.device).long()]
        if pos.numel() == 0:
            return 0, 0
        with torch.no_grad():
            head_dev = self.head.draft_rows_DH.device
            pred = self.head(cap.last_hidden_TH[pos.to(cap.last_hidden_TH.device)].to(head_dev)).argmax(-1)
        pred = pred.to(ids_T.device)
        agree, n = self._agree(pred, pos, ids_T, 0)
        if self.enforce and n >= MIN_POSITIONS and agree < self.min_share * n:
            raise UserError(f"capture of {where}: {self._fault(pred, pos, ids_T, agree, n)}; "
                            f"train.min_teacher_agreement = {self.min_share} (the rows are the target's greedy "
                            "replies, so its argmax from a true capture is the next token)")
        return agree, n

    def _agree(self, pred: torch.Tensor, pos: torch.Tensor, ids_T: torch.Tensor, shift: int) -> tuple[int, int]:
        """(agreeing, judged) comparing the argmax at `pos` with the token `1 + shift` further; a
        token off the draft vocab is out of the head's view and not judged."""
        at = pos + 1 + shift
        keep = (at >= 0) & (at < ids_T.numel())
        token = torch.full_like(pred, -1)
        token[keep] = ids_T[at[keep]]
        keep &= (token >= 0) & (token < self.draft_index_V.numel())  # an id past the head's vocab: not in view
        label = torch.full_like(pred, -1)
        label[keep] = self.draft_index_V[token[keep]]
        keep &= label >= 0
        return int((pred[keep] == label[keep]).sum()), int(keep.sum())

    def _fault(self, pred: torch.Tensor, pos: torch.Tensor, ids_T: torch.Tensor, agree: int, n: int) -> str:
        said = f"the target's argmax from the captured states matches the next token at {agree}/{n} positions"
        for s in SHIFTS:
            yes, judged = self._agree(pred, pos, ids_T, s)
            if judged >= MIN_POSITIONS and yes >= self.min_share * judged and yes * n > 2 * agree * judged:
                return (f"{said}, and the token {'after' if s > 0 else 'before'} it at {yes / judged:.0%}: the "
                        "states are shifted by one slot")
        return f"{said}: the states are not the target's for these tokens"
