"""Who is who in one online training world: trainer ranks [0, T), then one streamer per
verifier node [T, T+V); and the collective that opens its groups (`hpc.dist.planes`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hpc.dist.planes import Planes, init_planes, open_pairs


@dataclass
class World:
    rank: int
    n_trainers: int
    n_streamers: int

    @property
    def size(self) -> int:
        return self.n_trainers + self.n_streamers

    @property
    def is_trainer(self) -> bool:
        return self.rank < self.n_trainers

    @property
    def trainers(self) -> list[int]:
        return list(range(self.n_trainers))

    @property
    def streamers(self) -> list[int]:
        return list(range(self.n_trainers, self.size))


def init_world(w: World, backend: str, device: torch.device | str, master_addr: str, port: int, secret: str,
               timeout_s: float = 600.0, data_timeout_s: float | None = None, sample_bytes: int = 1) -> Planes:
    """Every rank's groups, on both planes, and every streamer -> trainer pair opened (collective:
    every rank of the world calls it, before any DDP collective can run)."""
    planes = init_planes(w.rank, w.size, w.trainers, backend, torch.device(device), master_addr, port, secret,
                         timeout_s, data_timeout_s)
    # DDP's default bucket (25 MiB): the trainers' first all-reduce happens here, not in step 1.
    open_pairs(planes, sample_bytes, bucket_bytes=25 * 2**20 if backend == "nccl" else 0)
    return planes
