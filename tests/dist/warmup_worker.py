"""One rank of the pair warm-up test (spawned, so importable): what open_pairs moves on the data plane."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import torch.distributed as dist


def main(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    from hpc.dist import planes as planes_mod

    seen: list[tuple[str, int]] = []
    for name in ("send", "recv", "all_reduce"):
        real = getattr(planes_mod.dist, name)

        @functools.wraps(real)  # the checker binds arguments by the real signature
        def record(tensor, *a, _real=real, _name=name, **kw):
            seen.append((_name, tensor.numel() * tensor.element_size()))
            return _real(tensor, *a, **kw)
        setattr(planes_mod.dist, name, record)
    planes = planes_mod.init_planes(rank, world, [0, 1], "gloo", torch.device("cpu"), "127.0.0.1", port,
                                    "warmup-test-" + "0" * 52, timeout_s=60)
    try:
        planes_mod.open_pairs(planes, sample_bytes=300_000, bucket_bytes=4096)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(seen))
    finally:
        dist.destroy_process_group()
