"""The teacher: the target's own next-token logits, from the last hidden state the capture delivers.

The draft learns, is calibrated and is judged against one distribution: the target's. That is
not `lm_head(hidden)` for every family (Granite divides it by `logits_scaling`, Gemma 2 soft-caps
it, Cohere scales it), so the rule for each accepted architecture lives in one table
(`hpc.model.families`, which `validate` reads too) and is applied here, in one place:

    hidden (post-norm; or pre-norm -> the target's final norm) -> lm_head (+ bias) -> transform

`target_logits` is the public form over the full vocabulary. Training and calibration hold a
`VerifierHead` restricted to the draft vocab: the transforms are elementwise, so restricting
the rows first gives exactly the full logits' draft-vocab columns.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from hpc.config.target import read_config_json, resolve_target
from hpc.errors import UserError
from hpc.model.families import rule_for, rule_problems
from hpc.model.target_weights import load_target_tensors

# What the teacher reads from the target's checkpoint (the bias only where there is one).
TEACHER_ROLES = ("lm_head", "lm_head_bias", "norm")


@dataclass(frozen=True)
class LogitTransform:
    """One target's rule with its numbers: its final norm, and what follows the lm_head."""

    norm: str = "rms"
    eps: float = 1e-6
    multiply: float = 1.0
    divide: float = 1.0
    softcap: float | None = None

    @classmethod
    def of(cls, architectures: list[str], text_config: dict, model: str = "") -> LogitTransform:
        """The transform for a target's config.json; one line naming `verifier.model` when the
        table cannot reproduce its logits."""
        problems = rule_problems(architectures, text_config)
        if problems:
            raise UserError(f"verifier.model = {model!r}: {problems[0]}")
        rule = rule_for(architectures)
        assert rule is not None  # rule_problems names a missing row
        eps = rule.value(text_config, rule.eps_key)
        return cls(norm=rule.norm, eps=float(eps if eps is not None else 1e-6),
                   multiply=float(rule.value(text_config, rule.multiply_key) or 1.0) if rule.multiply_key else 1.0,
                   divide=float(rule.value(text_config, rule.divide_key) or 1.0) if rule.divide_key else 1.0,
                   softcap=_float_or_none(rule.value(text_config, rule.softcap_key)) if rule.softcap_key else None)

    def final_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The target's final norm as its HF module computes it, rounding where it rounds."""
        x32 = x.float()
        if self.norm == "layernorm":  # Cohere: mean-centred, no bias, all in fp32
            centred = x32 - x32.mean(-1, keepdim=True)
            normed = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + self.eps)
            return (weight.float() * normed).to(x.dtype)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.norm == "rms_1p":  # Gemma: (1 + w), multiplied in fp32 before the cast
            return (normed * (1.0 + weight.float())).to(x.dtype)
        return weight.to(x.dtype) * normed.to(x.dtype)  # Llama/Qwen3/DeepseekV3: cast, then scale

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """What the target's forward does to `lm_head(hidden)`; the identity for most families."""
        if self.multiply != 1.0:
            logits = logits * self.multiply
        if self.divide != 1.0:
            logits = logits / self.divide
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def _float_or_none(value) -> float | None:
    return None if value is None else float(value)


class VerifierHead(nn.Module):
    """The frozen target head over the draft vocab's rows (`t2d_V`), with the target's final norm
    when the capture is pre-norm, and its logit transform."""

    draft_rows_DH: torch.Tensor  # buffers, registered in __init__
    bias_D: torch.Tensor | None
    full_VH: torch.Tensor | None
    full_bias_V: torch.Tensor | None
    t2d_V: torch.Tensor
    norm_H: torch.Tensor | None

    def __init__(self, lm_head_VH: torch.Tensor, t2d_V: torch.Tensor, norm_weight_H: torch.Tensor | None = None,
                 eps: float = 1e-6, keep_full: bool = False, bias_V: torch.Tensor | None = None,
                 transform: LogitTransform | None = None):
        super().__init__()
        self.transform = transform or LogitTransform(eps=eps)
        # Boolean indexing already copies, and a full vocab shares the caller's head rather than
        # copying it: at Kimi scale one lm_head is 2.3 GB, and nothing here writes to it.
        every = bool(t2d_V.all())
        self.register_buffer("draft_rows_DH", lm_head_VH.detach() if every else lm_head_VH[t2d_V])
        self.register_buffer("bias_D", None if bias_V is None else bias_V.detach() if every else bias_V[t2d_V])
        # The full head only serves the off-vocab mass metric.
        self.register_buffer("full_VH", lm_head_VH.detach() if keep_full else None)
        self.register_buffer("full_bias_V", bias_V.detach() if keep_full and bias_V is not None else None)
        self.register_buffer("t2d_V", t2d_V.clone())
        self.register_buffer("norm_H", norm_weight_H.detach() if norm_weight_H is not None else None)
        self.requires_grad_(False)

    def hidden(self, last_hidden: torch.Tensor) -> torch.Tensor:
        return self.transform.final_norm(last_hidden, self.norm_H) if self.norm_H is not None else last_hidden

    def _logits(self, last_hidden: torch.Tensor, rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        logits = self.hidden(last_hidden).to(rows.dtype) @ rows.T
        return self.transform.apply(logits + bias if bias is not None else logits)

    def forward(self, last_hidden_SH: torch.Tensor) -> torch.Tensor:
        """The target's logits over the draft vocab [S, D]."""
        return self._logits(last_hidden_SH, self.draft_rows_DH, self.bias_D)

    def full_logits(self, last_hidden_SH: torch.Tensor) -> torch.Tensor:
        """The target's logits over its whole vocab [S, V] (keep_full=True heads only)."""
        assert self.full_VH is not None, "built without keep_full"
        return self._logits(last_hidden_SH, self.full_VH, self.full_bias_V)


def target_config(target: str | Path) -> tuple[list[str], dict]:
    """(architectures, the language model's config) of a local directory or a resolved hub id."""
    root = Path(target) if Path(target).is_dir() else resolve_target(str(target), files=["config.json"])
    outer = read_config_json(root / "config.json", target)
    return list(outer.get("architectures") or []), outer.get("text_config") or outer


def target_transform(target: str | Path) -> LogitTransform:
    archs, text = target_config(target)
    return LogitTransform.of(archs, text, str(target))


def target_head(target: str | Path, t2d_V: torch.Tensor | None = None, pre_norm: bool = False,
                keep_full: bool = False, dtype: torch.dtype = torch.float32,
                tensors: dict[str, torch.Tensor] | None = None) -> VerifierHead:
    """The teacher for `target` (a local directory, or a hub id in the local cache): over the
    draft vocab `t2d_V` (all of it when None), taking pre-norm states when `pre_norm`.
    `tensors`: the target's tensors already read with TEACHER_ROLES, not read again."""
    transform = target_transform(target)
    if tensors is None:
        root = Path(target) if Path(target).is_dir() else resolve_target(str(target))
        tensors = load_target_tensors(root, TEACHER_ROLES)
    t = tensors
    lm_head_VH = t["lm_head"].to(dtype)
    t2d = t2d_V if t2d_V is not None else torch.ones(lm_head_VH.shape[0], dtype=torch.bool)
    bias = t.get("lm_head_bias")
    return VerifierHead(lm_head_VH, t2d, t["norm"] if pre_norm else None, keep_full=keep_full,
                        bias_V=bias.to(dtype) if bias is not None else None, transform=transform)


def loaded_target_head(hf_model) -> VerifierHead:
    """The teacher of a target already in memory (an HF *ForCausalLM, as the reference engine
    holds it): the same rule and the same arithmetic as `target_head`, on the model's own head."""
    cfg = hf_model.config.to_dict()
    text = cfg.get("text_config") or cfg
    transform = LogitTransform.of(list(cfg.get("architectures") or [type(hf_model).__name__]), text,
                                  str(cfg.get("_name_or_path", "")))
    out = hf_model.get_output_embeddings()
    lm_head_VH = out.weight.detach()
    bias = getattr(out, "bias", None)
    return VerifierHead(lm_head_VH, torch.ones(lm_head_VH.shape[0], dtype=torch.bool, device=lm_head_VH.device),
                        bias_V=bias.detach() if bias is not None else None, transform=transform)


@functools.lru_cache(maxsize=2)
def _full_head(target: str, pre_norm: bool, device: str) -> VerifierHead:
    # Keyed by device: Module.to moves a module in place, so one cached head shared by callers
    # on two devices would move back and forth under them.
    return target_head(target, pre_norm=pre_norm).to(device)


def target_logits(target: str | Path, last_hidden_TH: torch.Tensor, pre_norm: bool = False) -> torch.Tensor:
    """The target's full-vocabulary next-token logits [T, V] from its last hidden state as the
    capture delivers it: after the final norm (the default), or before it with `pre_norm`.
    Equal to the target's own forward's logits (tests/model/test_teacher.py, per architecture)."""
    head = _full_head(str(target), pre_norm, str(last_hidden_TH.device))
    return head(last_hidden_TH)
