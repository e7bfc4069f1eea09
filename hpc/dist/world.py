"""Who is who in one online training world: trainer ranks [0, T), then one streamer per
verifier node [T, T+V); and the collective that opens its groups (`hpc.dist.planes`).

A world may train several drafts from one capture (`groups` > 1, a sweep sharing the verifier):
the trainers then split into `groups` equal runs of consecutive ranks, each a DDP world of its
own (its rank 0 checkpoints and reports), and every streamer feeds each of them every sample."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hpc.dist.planes import Planes, init_planes, open_pairs


@dataclass
class World:
    rank: int
    n_trainers: int
    n_streamers: int
    groups: int = 1  # drafts trained from this world's one stream

    def __post_init__(self) -> None:
        if self.groups < 1 or self.n_trainers % self.groups:
            raise ValueError(f"{self.n_trainers} trainer ranks do not split into {self.groups} equal groups")

    @property
    def per_group(self) -> int:
        return self.n_trainers // self.groups

    @property
    def trainer_groups(self) -> list[list[int]]:
        """Each draft's trainer ranks, in group order."""
        return [list(range(g * self.per_group, (g + 1) * self.per_group)) for g in range(self.groups)]

    @property
    def group(self) -> int:
        """This trainer's group (its draft); -1 on a streamer."""
        return self.rank // self.per_group if self.is_trainer else -1

    @property
    def group_rank(self) -> int:
        """This trainer's rank in its group's DDP world: 0 checkpoints and reports."""
        return self.rank % self.per_group if self.is_trainer else -1

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
                         timeout_s, data_timeout_s, groups=w.trainer_groups)
    # DDP's default bucket (25 MiB): the trainers' first all-reduce happens here, not in step 1.
    open_pairs(planes, sample_bytes, bucket_bytes=25 * 2**20 if backend == "nccl" else 0)
    return planes
