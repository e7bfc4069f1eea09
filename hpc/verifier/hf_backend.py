"""In-process transformers verifier: captures aux and last hidden states for CPU runs.

Aux id i is the input of decoder layer i (HF `hidden_states[i]`); id == num_layers is the
last layer's output before the final norm, which HF does not return, so a pre-hook on the
final norm reads it. The last hidden is post-norm (what the lm_head sees) or pre-norm.
"""

from __future__ import annotations

import torch

from hpc.errors import UserError
from hpc.stream.sample import Capture


def _decoder(model):
    inner = getattr(model, "model", model)
    return getattr(inner, "language_model", inner)


class HFVerifier:
    def __init__(self, model_path: str, aux_layer_ids: list[int], final_hidden: str = "post_norm",
                 device: str = "cpu", dtype: torch.dtype = torch.float32, trust_remote_code: bool = False):
        from transformers import AutoModelForCausalLM  # transformers: loaded only on this path

        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=dtype, trust_remote_code=trust_remote_code, use_safetensors=True
        ).to(device).eval()  # type: ignore[arg-type]  # transformers' typing of .to loses the bound self
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
        assert self._pre_norm is not None  # the norm's pre-hook ran in this forward
        pre_norm = self._pre_norm[0]
        aux = [pre_norm if i == self.n_layers else hs[i][0] for i in self.aux_layer_ids]
        last = hs[-1][0] if self.final_hidden == "post_norm" else pre_norm
        states = torch.stack([*aux, last], dim=1).cpu()  # the model's dtype: the stream casts once
        return Capture.from_states(sample_id, ids.cpu(), torch.as_tensor(loss_mask, dtype=torch.long), states)
