"""Grouped-query attention without repeating K/V: the same numbers as repeated K/V, and less
memory, through each training attention (dense SDPA, tiled SDPA, eager flex)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from hpc.model.blocks import flex_attention_fn, select_anchors, tiled_sdpa_attention_fn, training_mask
from hpc.model.dspark import sdpa_attention
from hpc.model.layers import Attention


def _row(seed: int):
    g = torch.Generator().manual_seed(seed)
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate((300, 212))])
    anchors = select_anchors(torch.ones(doc_ids.numel(), dtype=torch.long), 4, max_anchors=24, generator=g)
    return g, anchors, doc_ids


def _attentions(anchors, doc_ids, B):
    return {"sdpa": sdpa_attention(training_mask(anchors, doc_ids, B)),
            "tiled": tiled_sdpa_attention_fn(anchors, doc_ids, B, tile_slots=32),
            "flex": flex_attention_fn(anchors, doc_ids, B, compiled=False)}


@pytest.mark.parametrize("kind", ["sdpa", "tiled", "flex"])
@pytest.mark.parametrize("heads", [(8, 2), (6, 3), (4, 4)])
def test_grouped_kv_equals_repeated_kv_forward_and_backward(kind, heads):
    nh, nkv = heads
    g, anchors, doc_ids = _row(seed=nh * 10 + nkv)
    B, T, hd = 4, doc_ids.numel(), 16
    Q, K = anchors.numel() * B, T + anchors.numel() * B
    grad = kind != "flex"  # eager flex has no CPU backward; its GPU backward is gpu-check's
    q = torch.randn(1, nh, Q, hd, generator=g, dtype=torch.float64, requires_grad=grad)
    k, v = (torch.randn(1, nkv, K, hd, generator=g, dtype=torch.float64, requires_grad=grad) for _ in range(2))
    attend = _attentions(anchors, doc_ids, B)[kind]
    grouped = attend(q, k, v)
    repeated = attend(q, k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1))
    torch.testing.assert_close(grouped, repeated, rtol=1e-10, atol=1e-10)
    if not grad:
        return
    w = torch.randn(grouped.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad((grouped * w).sum(), (q, k, v)),
                    torch.autograd.grad((repeated * w).sum(), (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def _peak_bytes(fn) -> int:
    tracker = MemTracker()
    with tracker:
        fn().sum().backward()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


@pytest.mark.parametrize("kind", ["sdpa", "tiled"])
def test_a_layer_holds_less_than_with_repeated_kv(kind):
    """The layer's forward + backward peak, against the same layer fed K/V repeated per query
    head (what it did before): Kimi's 56/8 heads made that 7x the context's K/V."""
    g, anchors, doc_ids = _row(seed=3)
    B, T, nh, nkv, hd, hidden = 4, doc_ids.numel(), 8, 1, 16, 64
    layer = Attention(hidden, nh, nkv, hd, eps=1e-6)
    x = torch.randn(anchors.numel() * B, hidden, generator=g)
    ctx = torch.randn(T, hidden, generator=g)
    cos, sin = torch.ones(x.shape[0], hd), torch.zeros(x.shape[0], hd)
    ccos, csin = torch.ones(T, hd), torch.zeros(T, hd)
    attend = _attentions(anchors, doc_ids, B)[kind]

    def repeating(q, k, v):
        return attend(q, k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1))

    def run(fn):
        return lambda: layer(x, cos, sin, *layer.context_kv(ctx, ccos, csin), fn)

    torch.testing.assert_close(run(attend)(), run(repeating)())
    grouped, repeated = _peak_bytes(run(attend)), _peak_bytes(run(repeating))
    assert grouped < 0.8 * repeated, (grouped, repeated)
