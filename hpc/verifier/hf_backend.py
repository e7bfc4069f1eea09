"""In-process transformers verifier: captures aux and last hidden states for CPU runs.

Aux id i is the input of decoder layer i (HF `hidden_states[i]`); id == num_layers is the
last layer's output before the final norm, which HF does not return, so a pre-hook on the
final norm reads it. The last hidden is post-norm (what the lm_head sees) or pre-norm.
"""

from __future__ import annotations

from dataclasses import dataclass

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
                    states_TnH: torch.Tensor) -> "Capture":
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


def _decoder(model):
    inner = getattr(model, "model", model)
    return getattr(inner, "language_model", inner)


class HFVerifier:
    def __init__(self, model_path: str, aux_layer_ids: list[int], final_hidden: str = "post_norm",
                 device: str = "cpu", dtype: torch.dtype = torch.float32, trust_remote_code: bool = False):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=dtype, trust_remote_code=trust_remote_code, use_safetensors=True
        ).to(device).eval()
        self.device = device
        self.aux_layer_ids = list(aux_layer_ids)
        self.final_hidden = final_hidden
        self.n_layers = self.model.config.num_hidden_layers
        if max(self.aux_layer_ids) > self.n_layers:
            raise UserError(f"aux layer id {max(self.aux_layer_ids)} > the target's {self.n_layers} layers")
        self._pre_norm: torch.Tensor | None = None
        _decoder(self.model).norm.register_forward_pre_hook(self._grab)

    def _grab(self, _module, args):
        self._pre_norm = args[0]

    @torch.no_grad()
    def capture(self, sample_id: int, input_ids: list[int] | torch.Tensor, loss_mask) -> Capture:
        ids = torch.as_tensor(input_ids, dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids[None], output_hidden_states=True, use_cache=False)
        hs = out.hidden_states
        pre_norm = self._pre_norm[0]
        aux = [pre_norm if i == self.n_layers else hs[i][0] for i in self.aux_layer_ids]
        last = hs[-1][0] if self.final_hidden == "post_norm" else pre_norm
        states = torch.stack([*aux, last], dim=1).float().cpu()
        return Capture.from_states(sample_id, ids.cpu(), torch.as_tensor(loss_mask, dtype=torch.long), states)
