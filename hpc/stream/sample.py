"""What the stream carries: one captured sample (`Capture`), as every verifier backend returns
it, and the micro-batch (`MicroBatch`) the receiver hands each trainer rank.

They live here, the lowest layer that uses them: verifiers build Captures, the stream moves
them, the trainer packs MicroBatches into rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hpc.errors import UserError


@dataclass
class Capture:
    """One sample as every verifier backend returns it."""

    sample_id: int
    input_ids_T: torch.Tensor
    loss_mask_T: torch.Tensor
    aux_TnH: torch.Tensor  # [T, n_aux, H]
    last_hidden_TH: torch.Tensor  # [T, H]
    # [T, n_aux + 1, H] that aux and last are views of, when built so: the streamer sends it as
    # one message instead of two (and copies nothing).
    states_TnH: torch.Tensor | None = None

    @classmethod
    def from_states(cls, sample_id: int, input_ids_T: torch.Tensor, loss_mask_T: torch.Tensor,
                    states_TnH: torch.Tensor) -> Capture:
        """aux = states[:, :-1], last hidden = states[:, -1]."""
        return cls(sample_id, input_ids_T, loss_mask_T, states_TnH[:, :-1], states_TnH[:, -1], states_TnH)

    def packed_states(self) -> torch.Tensor:
        if self.states_TnH is not None:
            return self.states_TnH
        return torch.cat([self.aux_TnH, self.last_hidden_TH[:, None]], dim=1)

    def check(self, n_aux: int, hidden: int) -> None:
        """A capture of the wrong shape must stop the run at the first sample, not train garbage."""
        T = self.input_ids_T.numel()
        want = (T, n_aux, hidden)
        if tuple(self.aux_TnH.shape) != want or tuple(self.last_hidden_TH.shape) != (T, hidden):
            raise UserError(
                f"capture of sample {self.sample_id} has aux {tuple(self.aux_TnH.shape)} and last hidden "
                f"{tuple(self.last_hidden_TH.shape)}, config expects aux {want} (verifier.aux_layer_ids, "
                f"verifier.hidden_size); fix the config to match the target")


@dataclass
class MicroBatch:
    mine: list[Capture]  # this rank's samples
    consumed: list[tuple[int, int]]  # every rank's (epoch, sample id) of this micro-step, in order
    # Called once the samples are packed into the step's row: their receive buffers are free.
    release: Callable[[], object] | None = None
    # every rank's (epoch, sample id) a streamer could not capture: done for the ledger, never trained
    skipped: list[tuple[int, int]] = field(default_factory=list)
    origins: list[str] = field(default_factory=list)  # who sent each of `mine` (a streamer's name), for messages
