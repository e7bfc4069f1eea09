"""Wire format between streamers (verifier nodes) and trainers, over torch.distributed p2p.

One code path for NCCL (GPU tensors) and gloo (CPU tensors). Every message starts with a
fixed-size int64 header, so a receiver can post its receive before it knows the sender:
NCCL has no receive-from-any-source, so trainers post one header receive per streamer and
poll them. A sample is then two more tensors: token ids + loss mask [2, T], and the aux states
with the last hidden as one more column, [T, n_aux + 1, H], in the stream dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch
import torch.distributed as dist

from hpc.verifier.hf_backend import Capture

HEADER_LEN = 8
DTYPES = {0: torch.float32, 1: torch.bfloat16, 2: torch.float16}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}


class Kind(IntEnum):
    SAMPLE = 1
    HEARTBEAT = 2  # a live streamer with nothing to send: keeps the trainer's watchdog quiet
    STOP = 3  # this streamer has no more samples
    CREDIT = 4  # trainer -> streamer: n more samples may be sent to me
    LEDGER = 5  # trainer 0 -> streamer: n sample ids already trained this epoch follow


@dataclass
class Header:
    kind: Kind
    sample_id: int = 0
    length: int = 0  # tokens T (SAMPLE), credits (CREDIT), ids (LEDGER)
    n_aux: int = 0
    hidden: int = 0
    epoch: int = 0
    dtype: int = 0

    def tensor(self, device) -> torch.Tensor:
        return torch.tensor([int(self.kind), self.sample_id, self.length, self.n_aux, self.hidden, self.epoch,
                             self.dtype, 0], dtype=torch.int64, device=device)

    @classmethod
    def parse(cls, t: torch.Tensor) -> "Header":
        v = t.tolist()
        return cls(Kind(v[0]), v[1], v[2], v[3], v[4], v[5], v[6])


def empty_header(device) -> torch.Tensor:
    return torch.zeros(HEADER_LEN, dtype=torch.int64, device=device)


def send_header(h: Header, dst: int, device) -> None:
    dist.send(h.tensor(device), dst=dst)


def send_sample(cap: Capture, epoch: int, dst: int, device, dtype: torch.dtype) -> int:
    """Blocking send of one capture; returns the payload bytes."""
    T, n_aux, H = cap.aux_TnH.shape
    send_header(Header(Kind.SAMPLE, cap.sample_id, T, n_aux, H, epoch, DTYPE_CODES[dtype]), dst, device)
    ids = torch.stack([cap.input_ids_T.long(), cap.loss_mask_T.long()]).to(device)
    # aux + last in one message: every message costs a round of gloo/NCCL bookkeeping.
    states = cap.packed_states().to(device=device, dtype=dtype).contiguous()
    dist.send(ids, dst=dst)
    dist.send(states, dst=dst)
    return ids.numel() * 8 + states.numel() * states.element_size()


def recv_sample_body(h: Header, src: int, device) -> Capture:
    ids = torch.empty(2, h.length, dtype=torch.int64, device=device)
    states = torch.empty(h.length, h.n_aux + 1, h.hidden, dtype=DTYPES[h.dtype], device=device)
    dist.recv(ids, src=src)
    dist.recv(states, src=src)
    return Capture.from_states(h.sample_id, ids[0], ids[1], states)


def send_ledger(pairs: list[list[int]], epoch: int, dst: int, device) -> None:
    """The trainer's ledger: (epoch, sample id) pairs already trained, from `epoch` on."""
    send_header(Header(Kind.LEDGER, length=len(pairs), epoch=epoch), dst, device)
    if pairs:
        dist.send(torch.tensor(pairs, dtype=torch.int64, device=device).reshape(len(pairs), 2), dst=dst)


def recv_ledger(h: Header, src: int, device) -> list[list[int]]:
    if h.length == 0:
        return []
    t = torch.empty(h.length, 2, dtype=torch.int64, device=device)
    dist.recv(t, src=src)
    return t.tolist()
