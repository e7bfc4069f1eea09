"""The connector's gather out of vLLM's hidden-state cache (torch only: runs without vLLM)."""

from __future__ import annotations

import torch

from hpc.verifier.capture_copy import HostCopier, gather_blocks


def test_gather_reads_each_token_from_its_block_and_slot():
    g = torch.Generator().manual_seed(0)
    n_blocks, n_ids, bs, H, T = 12, 4, 16, 8, 70
    cache = torch.randn(n_blocks, n_ids, bs, H, generator=g)
    blocks = torch.randperm(n_blocks, generator=g)[: -(-T // bs)].tolist()
    got = gather_blocks(cache, blocks, T)
    want = torch.stack([cache[blocks[t // bs], :, t % bs] for t in range(T)])
    assert got.shape == (T, n_ids, H) and torch.equal(got, want)
    cache.zero_()  # the gather is a copy: vLLM may reuse the blocks at once
    assert torch.equal(got, want)
    host = HostCopier(torch.device("cpu")).copy(got)
    assert torch.equal(host.result(), want) and host.result().is_contiguous()
