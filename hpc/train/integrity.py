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
FAULTS = ("hold NaN or infinity", "are all zero", "are the same vector at every position")
# A measurement: [fault, agree, judged, agree at t - 1, judged, agree at t + 1, judged] (SHIFTS' order)
AGREE, JUDGED = 1, 2


def layer_names(n_aux: int) -> list[str]:
    return ["last hidden"] + [f"aux layer {i}" for i in range(n_aux)]


def state_faults(cap: Capture) -> torch.Tensor:
    """0 when the states are sound numbers, else 1 + the first (layer, fault) found, layers in
    `layer_names` order and faults in FAULTS order: a device scalar, read with the step's metrics."""
    flags = []
    for x_TH in [cap.last_hidden_TH] + [cap.aux_TnH[:, i] for i in range(cap.aux_TnH.shape[1])]:
        const = (x_TH == x_TH[:1]).all() if x_TH.shape[0] > 1 else torch.zeros((), dtype=torch.bool, device=x_TH.device)
        flags.append(torch.stack([~torch.isfinite(x_TH).all(), ~x_TH.any(), const.to(x_TH.device)]))
    flat = torch.cat(flags)
    return torch.where(flat.any(), flat.to(torch.uint8).argmax() + 1, 0)  # argmax: the first fault


def state_problem(cap: Capture) -> str | None:
    """What is wrong with the captured states as numbers, or None (one host read)."""
    return fault_text(int(state_faults(cap)), cap.aux_TnH.shape[1])


def fault_text(code: int, n_aux: int) -> str | None:
    if code == 0:
        return None
    layer, fault = divmod(code - 1, len(FAULTS))
    return f"its {layer_names(n_aux)[layer]} states {FAULTS[fault]}"


class TeacherAgreement:
    """Per sample: (positions agreeing at the true slot, positions checked); raises on a fault.

    `measure` runs on the device without one host read, so the trainer's next micro-batch can be
    packed while the GPU works; its numbers come back with the step's one read and `judge` decides
    there. Calling the object does both at once."""

    def __init__(self, head: VerifierHead, min_share: float, enforce: bool):
        self.head, self.min_share, self.enforce = head, min_share, enforce
        t2d = head.t2d_V.bool()
        # target id -> its row in the draft vocab, -1 off it (such a token's argmax is not in view)
        self.draft_index_V = torch.where(t2d, torch.cumsum(t2d.long(), 0) - 1, -1)

    def __call__(self, cap: Capture, origin: str = "") -> tuple[int, int]:
        return self.judge(self.measure(cap).tolist(), cap.sample_id, origin, cap.aux_TnH.shape[1])

    def measure(self, cap: Capture) -> torch.Tensor:
        """The measurement (see AGREE, JUDGED) as a float64 vector on the head's device."""
        dev = self.draft_index_V.device
        fault = state_faults(cap).to(dev, torch.float64)
        ids_T = cap.input_ids_T.to(dev).long()
        T = ids_T.numel()
        if T < 2:
            return torch.cat([fault[None], torch.zeros(6, dtype=torch.float64, device=dev)])
        # position t predicts t + 1: looked at where t + 1 is a trained (assistant) token; up to
        # MAX_POSITIONS of them, evenly spaced, found on the device (a boolean index would wait for it)
        rank_T = torch.cumsum(cap.loss_mask_T.to(dev)[1:].long(), 0)
        count = rank_T[-1]
        j = torch.arange(MAX_POSITIONS, device=dev)
        k = torch.where(count > MAX_POSITIONS, j * (count - 1) // (MAX_POSITIONS - 1), j)
        valid = j < count
        pos = torch.searchsorted(rank_T, k + 1).clamp(max=T - 2)
        with torch.no_grad():
            head_dev = self.head.draft_rows_DH.device
            pred = self.head(cap.last_hidden_TH[pos.to(cap.last_hidden_TH.device)].to(head_dev)).argmax(-1).to(dev)
        parts = [fault]
        for shift in (0, *SHIFTS):
            parts.extend(self._agree(pred, pos, valid, ids_T, shift))
        return torch.stack(parts)

    def _agree(self, pred: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, ids_T: torch.Tensor,
               shift: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(agreeing, judged) comparing the argmax at `pos` with the token `1 + shift` further; a
        token off the draft vocab is out of the head's view and not judged."""
        T, V = ids_T.numel(), self.draft_index_V.numel()
        at = pos + 1 + shift
        keep = valid & (at >= 0) & (at < T)
        token = ids_T[at.clamp(0, T - 1)]
        keep &= (token >= 0) & (token < V)  # an id past the head's vocab: not in view
        label = self.draft_index_V[token.clamp(0, V - 1)]
        keep &= label >= 0
        return ((pred == label) & keep).sum().double(), keep.sum().double()

    def judge(self, m: list[float], sample_id: int, origin: str, n_aux: int) -> tuple[int, int]:
        """Raises the one line for a fault in measurement `m`; else (agree, judged)."""
        where = f"sample {sample_id}" + (f" from {origin}" if origin else "")
        if (why := fault_text(int(m[0]), n_aux)) is not None:
            raise UserError(f"capture of {where}: {why}; the verifier's hidden-state capture is broken "
                            "(check verifier.backend, verifier.aux_layer_ids and that node's vLLM log)")
        agree, n = int(m[AGREE]), int(m[JUDGED])
        if self.enforce and n >= MIN_POSITIONS and agree < self.min_share * n:
            raise UserError(f"capture of {where}: {self._fault(m, agree, n)}; "
                            f"train.min_teacher_agreement = {self.min_share} (the rows are the target's greedy "
                            "replies, so its argmax from a true capture is the next token)")
        return agree, n

    def _fault(self, m: list[float], agree: int, n: int) -> str:
        said = f"the target's argmax from the captured states matches the next token at {agree}/{n} positions"
        for i, s in enumerate(SHIFTS):
            yes, judged = int(m[3 + 2 * i]), int(m[4 + 2 * i])
            if judged >= MIN_POSITIONS and yes >= self.min_share * judged and yes * n > 2 * agree * judged:
                return (f"{said}, and the token {'after' if s > 0 else 'before'} it at {yes / judged:.0%}: the "
                        "states are shifted by one slot")
        return f"{said}: the states are not the target's for these tokens"
