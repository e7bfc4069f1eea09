"""Qwen3 building blocks for the DSpark draft, with keys/values over [context | block].

Names of modules match the tensor names vLLM loads (`layers.{i}.self_attn.q_proj`, ...), so a
state dict is already the export. Shapes: T context tokens, Q query slots, H hidden,
nh/nkv heads, hd head dim.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

# attention(q_BhQd, k_BgKd, v_BgKd) -> out_BhQd, with g K/V heads dividing h query heads (GQA);
# the mask, if any, lives inside the callable.
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 as Qwen3 does; bf16 variance loses the small-activation tail.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin [*, hd] for absolute positions, neox layout (two halves, rotate_half)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x_hSd: torch.Tensor, cos_Sd: torch.Tensor, sin_Sd: torch.Tensor) -> torch.Tensor:
    half = x_hSd.shape[-1] // 2
    rotated = torch.cat([-x_hSd[..., half:], x_hSd[..., :half]], dim=-1)
    return x_hSd * cos_Sd + rotated * sin_Sd


class Attention(nn.Module):
    def __init__(self, hidden: int, n_heads: int, n_kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, n_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def _heads(self, x_SD: torch.Tensor, n: int) -> torch.Tensor:
        return x_SD.view(x_SD.shape[0], n, self.head_dim).transpose(0, 1)  # [h, S, hd]

    def context_kv(self, ctx_TH: torch.Tensor, cos_Td, sin_Td) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the projected target context: k_norm + RoPE on K, nothing on V, no input norm."""
        k_hTd = apply_rope(self.k_norm(self._heads(self.k_proj(ctx_TH), self.n_kv_heads)), cos_Td, sin_Td)
        return k_hTd, self._heads(self.v_proj(ctx_TH), self.n_kv_heads)

    def forward(
        self, x_QH: torch.Tensor, cos_Qd, sin_Qd, ctx_k_hTd: torch.Tensor, ctx_v_hTd: torch.Tensor,
        attention: AttentionFn,
    ) -> torch.Tensor:
        q_hQd = apply_rope(self.q_norm(self._heads(self.q_proj(x_QH), self.n_heads)), cos_Qd, sin_Qd)
        k_hQd = apply_rope(self.k_norm(self._heads(self.k_proj(x_QH), self.n_kv_heads)), cos_Qd, sin_Qd)
        v_hQd = self._heads(self.v_proj(x_QH), self.n_kv_heads)
        k_hKd = torch.cat([ctx_k_hTd, k_hQd], dim=1)
        v_hKd = torch.cat([ctx_v_hTd, v_hQd], dim=1)
        if torch.is_autocast_enabled(q_hQd.device.type):
            # The fp32 norm weights promote q/k back to fp32; attention runs in the autocast dtype.
            dt = torch.get_autocast_dtype(q_hQd.device.type)
            q_hQd, k_hKd, v_hKd = q_hQd.to(dt), k_hKd.to(dt), v_hKd.to(dt)
        # K/V keep their nkv heads: the attention groups query heads over them (GQA) rather than
        # repeating K/V, which at Kimi's 56/8 heads held 7x the context's K/V per layer.
        out_hQd = attention(q_hQd[None], k_hKd[None], v_hKd[None])[0]
        return self.o_proj(out_hQd.transpose(0, 1).reshape(x_QH.shape[0], -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, hidden: int, n_heads: int, n_kv_heads: int, head_dim: int, intermediate: int, eps: float):
        super().__init__()
        self.self_attn = Attention(hidden, n_heads, n_kv_heads, head_dim, eps)
        self.mlp = MLP(hidden, intermediate)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, x_QH, cos_Qd, sin_Qd, ctx_TH, ctx_cos_Td, ctx_sin_Td, attention: AttentionFn,
                ctx_kv: tuple[torch.Tensor, torch.Tensor] | None = None):
        """`ctx_kv`: this layer's context K/V computed once for several calls over one context."""
        ctx_k, ctx_v = ctx_kv if ctx_kv is not None else self.self_attn.context_kv(ctx_TH, ctx_cos_Td, ctx_sin_Td)
        x_QH = x_QH + self.self_attn(self.input_layernorm(x_QH), cos_Qd, sin_Qd, ctx_k, ctx_v, attention)
        return x_QH + self.mlp(self.post_attention_layernorm(x_QH))
