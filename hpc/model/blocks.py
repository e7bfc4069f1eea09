"""Training blocks: anchor choice, block layout, targets and the attention mask.

One packed row holds T tokens from one or more documents (doc_ids_T). Each anchor p opens a
block of B slots at positions p..p+B-1. Block j may attend to context tokens of its own
document before p_j and to its own slots, nothing else: that is exactly what it sees when
drafting at p_j in decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.utils._triton import has_triton

from hpc.errors import UserError
from hpc.model.layers import AttentionFn


def select_anchors(loss_mask_T: torch.Tensor, block_size: int, max_anchors: int,
                   generator: torch.Generator | None = None, to_end: bool = False) -> torch.Tensor:
    """Sorted random anchors inside the loss mask, never in the last B positions of the row, or
    with `to_end` anywhere but the last one: decoding drafts there too, so calibration does
    (the blocks' slots past the row are invalid)."""
    T = loss_mask_T.numel()
    valid = loss_mask_T.bool().clone()
    valid[max(T - (1 if to_end else block_size), 0):] = False
    candidates = torch.nonzero(valid).flatten()
    if candidates.numel() > max_anchors:
        pick = torch.randperm(candidates.numel(), generator=generator)[:max_anchors]
        candidates = candidates[pick]
    return torch.sort(candidates).values


@dataclass
class Blocks:
    """Everything one training forward needs about N blocks of B slots."""

    anchors_N: torch.Tensor
    block_ids_NB: torch.Tensor  # model inputs [anchor, MASK...]
    block_pos_NB: torch.Tensor  # absolute (document-relative) RoPE positions
    prev_ids_NB: torch.Tensor  # Markov inputs: the token before each slot's prediction
    target_idx_NB: torch.Tensor  # row index whose verifier distribution is the slot's target
    valid_NB: torch.Tensor  # slot is supervised


def make_blocks(input_ids_T: torch.Tensor, loss_mask_T: torch.Tensor, position_ids_T: torch.Tensor,
                doc_ids_T: torch.Tensor, anchors_N: torch.Tensor, block_size: int, mask_token_id: int,
                sample_from_anchor: bool) -> Blocks:
    T, B = input_ids_T.numel(), block_size
    k_B = torch.arange(B, device=anchors_N.device)
    slot_idx_NB = anchors_N[:, None] + k_B  # row index of each slot's position
    block_ids_NB = torch.full_like(slot_idx_NB, mask_token_id)
    block_ids_NB[:, 0] = input_ids_T[anchors_N]
    block_pos_NB = position_ids_T[anchors_N][:, None] + k_B
    in_row = slot_idx_NB < T
    safe_idx = slot_idx_NB.clamp(max=T - 1)
    if sample_from_anchor:
        # Slot k predicts token p+k+1: target is the verifier's distribution at p+k; the token
        # before it is x_{p+k} (the anchor itself for slot 0).
        target_idx_NB = safe_idx
        prev_ids_NB = input_ids_T[safe_idx]
        valid_NB = in_row & loss_mask_T.bool()[safe_idx]
    else:
        # DFlash: slot 0 is the bonus; slot k >= 1 predicts token p+k, i.e. the verifier's
        # distribution at p+k-1, after token x_{p+k-1}.
        target_idx_NB = (slot_idx_NB - 1).clamp(min=0, max=T - 1)
        prev_ids_NB = input_ids_T[target_idx_NB]
        valid_NB = in_row & loss_mask_T.bool()[target_idx_NB]
    # A block running past its document's end would learn the next document's tokens.
    valid_NB &= doc_ids_T[target_idx_NB] == doc_ids_T[anchors_N][:, None]
    if not sample_from_anchor:  # the bonus: never supervised (below), but it must not end the prefix
        valid_NB[:, 0] = True
    # Only the contiguous prefix: past a short user turn (a gap in the loss mask, under B tokens)
    # the slots would predict the next reply without the turn it answers. The mask is read at
    # the target's position, as speculators does, so the slot after a reply's last token counts.
    valid_NB = torch.cumprod(valid_NB.long(), dim=1).bool()
    if not sample_from_anchor:
        valid_NB[:, 0] = False
    return Blocks(anchors_N, block_ids_NB, block_pos_NB, prev_ids_NB, target_idx_NB, valid_NB)


def training_mask(anchors_N: torch.Tensor, doc_ids_T: torch.Tensor, block_size: int) -> torch.Tensor:
    """Boolean [N*B, T + N*B], True where a block slot may attend (for SDPA)."""
    return _mask_ctx_range(anchors_N, doc_ids_T, block_size, 0, doc_ids_T.numel())


def _mask_ctx_range(anchors_N: torch.Tensor, doc_ids_T: torch.Tensor, block_size: int, lo: int,
                    hi: int) -> torch.Tensor:
    """The rows of `training_mask` for these blocks, over context columns lo..hi-1 then their own slots."""
    N, B = anchors_N.numel(), block_size
    q_block = torch.arange(N * B, device=anchors_N.device) // B
    t = torch.arange(lo, hi, device=anchors_N.device)
    anchor_Q = anchors_N[q_block]
    ctx_QT = (t[None, :] < anchor_Q[:, None]) & (doc_ids_T[lo:hi][None, :] == doc_ids_T[anchor_Q][:, None])
    own_QQ = q_block[:, None] == q_block[None, :]
    return torch.cat([ctx_QT, own_QQ], dim=1)


def tiled_sdpa_attention_fn(anchors_N: torch.Tensor, doc_ids_T: torch.Tensor, block_size: int,
                            tile_slots: int = 256) -> AttentionFn:
    """SDPA under `training_mask`, scoring only the keys a tile of blocks can see.

    With one dense mask every slot scores all T + N*B keys, though block j sees only its own
    document before p_j and its own B slots: at 8 packed sequences over 90% of the work is
    masked out. Anchors are sorted and documents contiguous, so a tile of consecutive blocks
    needs the context from its first block's document start to its last anchor, plus its own
    slots. Masked keys add exactly zero, so the result equals the dense one.
    """
    N, T, B = anchors_N.numel(), doc_ids_T.numel(), block_size
    per_tile = max(1, tile_slots // B)
    new_doc = torch.ones(T, dtype=torch.bool, device=doc_ids_T.device)
    new_doc[1:] = doc_ids_T[1:] != doc_ids_T[:-1]
    idx_T = torch.arange(T, device=doc_ids_T.device)
    doc_start_T = torch.cummax(torch.where(new_doc, idx_T, 0), dim=0).values
    starts = doc_start_T[anchors_N].tolist()
    ends = anchors_N.tolist()
    tiles = []  # (first slot, end slot, context lo, context hi, mask over those keys)
    for j0 in range(0, N, per_tile):
        j1 = min(j0 + per_tile, N)
        lo, hi = starts[j0], ends[j1 - 1]
        tiles.append((j0 * B, j1 * B, lo, hi, _mask_ctx_range(anchors_N[j0:j1], doc_ids_T, B, lo, hi)))

    spans = [(lo, hi, T + q0, T + q1) for q0, q1, lo, hi, _ in tiles]

    def attend(q, k, v):
        k_tiles, v_tiles = _TileKeys.apply(k, spans), _TileKeys.apply(v, spans)
        gqa = k.shape[-3] != q.shape[-3]
        outs = [F.scaled_dot_product_attention(q[..., q0:q1, :], k_t, v_t, attn_mask=mask, enable_gqa=gqa)
                for (q0, q1, _, _, mask), k_t, v_t in zip(tiles, k_tiles, v_tiles)]
        return torch.cat(outs, dim=-2)
    return attend


class _TileKeys(torch.autograd.Function):
    """Per tile, keys [x[lo:hi] | x[b0:b1]] along dim -2; backward sums into ONE gradient.

    Plain slicing would allocate a zero gradient of x's full size per tile in backward: with
    ~tens of tiles that dominated the step.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, spans: list[tuple[int, int, int, int]]):
        ctx.spans, ctx.shape = spans, x.shape
        return tuple(torch.cat([x[..., lo:hi, :], x[..., b0:b1, :]], dim=-2) for lo, hi, b0, b1 in spans)

    @staticmethod
    def backward(ctx, *grads):
        present = [g for g in grads if g is not None]
        if not present:
            return None, None
        grad = present[0].new_zeros(ctx.shape)
        for (lo, hi, b0, b1), g in zip(ctx.spans, grads):
            if g is None:  # a tile whose output did not reach the loss
                continue
            grad[..., lo:hi, :] += g[..., :hi - lo, :]
            grad[..., b0:b1, :] += g[..., hi - lo:, :]
        return grad, None


_compiled_flex = None  # one compiled flex_attention per process: compiling per call would recompile


def _flex_attention(compiled: bool):
    global _compiled_flex

    if not compiled:
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex


def flex_attention_fn(anchors_N: torch.Tensor, doc_ids_T: torch.Tensor, block_size: int,
                      compiled: bool | None = None) -> AttentionFn:
    """The same mask as `training_mask`, as a flex_attention block mask (sparse: O(T) memory).

    At Kimi scale (T=20000, N=3072, B=8) the dense mask is 1.1 GB per row; the block mask
    skips fully masked tiles instead. Only compiled flex_attention is fused: called eagerly it
    materialises the scores (hundreds of GB per layer at Kimi dims), so on CUDA both the
    attention and the block mask are compiled, on the tensors' own device (never cuda:0 by
    default). Eager runs serve CPU tests of the mask.
    """
    N, T, B = anchors_N.numel(), doc_ids_T.numel(), block_size
    anchors, docs = anchors_N, doc_ids_T
    # The row length as a tensor, not a Python int the compiled mask would guard on: every
    # packed row has its own length, and a recompile per length would soon hit dynamo's limit.
    T_t = torch.tensor(T, device=anchors_N.device)
    if compiled is None:
        compiled = anchors_N.device.type == "cuda"

    def mask_mod(b, h, q_idx, kv_idx):
        block = q_idx // B
        anchor = anchors[block]
        in_ctx = kv_idx < T_t
        ctx_ok = in_ctx & (kv_idx < anchor) & (docs[torch.clamp(kv_idx, max=T_t - 1)] == docs[anchor])
        own_ok = (~in_ctx) & ((kv_idx - T_t) // B == block)
        return ctx_ok | own_ok

    block_mask = create_block_mask(mask_mod, None, None, N * B, T + N * B, device=anchors_N.device,
                                   _compile=compiled)
    flex = _flex_attention(compiled)

    def attend(q, k, v):
        return flex(q, k, v, block_mask=block_mask, enable_gqa=k.shape[-3] != q.shape[-3])
    return attend


def check_attention(kind: str, device: torch.device) -> str:
    """The attention a run will use ("flex" or "sdpa"); one line naming the fix when it cannot run here."""
    if kind == "auto":
        kind = "flex" if device.type == "cuda" else "sdpa"
    if kind != "flex":
        return kind
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        raise UserError(f"train.attention=flex: torch {torch.__version__} has no flex_attention (needs >= 2.5); "
                        "use train.attention=sdpa") from None
    if device.type == "cuda":
        if not has_triton():
            raise UserError(f"train.attention=flex: compiled flex_attention needs Triton, which this torch "
                            f"{torch.__version__} build lacks; install triton or use train.attention=sdpa")
    return kind
