"""The tiled SDPA training attention equals SDPA under the dense training mask."""

from __future__ import annotations

import pytest
import torch

from hpc.model.blocks import select_anchors, tiled_sdpa_attention_fn, training_mask
from hpc.model.dspark import sdpa_attention


@pytest.mark.parametrize("tile_slots", [4, 12, 40, 10_000])
def test_tiles_equal_the_dense_mask_forward_and_backward(tile_slots):
    g = torch.Generator().manual_seed(0)
    docs = [15, 9, 30, 6]  # packed; some tiles straddle documents, one doc gets no anchor
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(docs)])
    T, B, nh, hd = doc_ids.numel(), 4, 2, 8
    loss_mask = torch.ones(T, dtype=torch.long)
    loss_mask[15:24] = 0
    anchors = select_anchors(loss_mask, B, max_anchors=13, generator=g)
    Q, K = anchors.numel() * B, T + anchors.numel() * B
    q, k, v = (torch.randn(1, nh, n, hd, generator=g, dtype=torch.float64, requires_grad=True) for n in (Q, K, K))
    dense = sdpa_attention(training_mask(anchors, doc_ids, B))(q, k, v)
    tiled = tiled_sdpa_attention_fn(anchors, doc_ids, B, tile_slots=tile_slots)(q, k, v)
    torch.testing.assert_close(tiled, dense, rtol=1e-12, atol=1e-12)
    w = torch.randn(dense.shape, generator=g, dtype=torch.float64)
    grads_dense = torch.autograd.grad((dense * w).sum(), (q, k, v))
    grads_tiled = torch.autograd.grad((tiled * w).sum(), (q, k, v))
    for a, b in zip(grads_tiled, grads_dense):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
