"""Packing captures into one training row."""

from __future__ import annotations

import torch


def test_a_packed_row_lives_where_its_captures_do():
    """gpu-check's calibrate pass packs GPU captures and reads the row as is: document ids and
    positions made on the CPU beside CUDA tokens failed its first comparison. (meta stands in.)"""
    from hpc.stream.sample import Capture
    from hpc.train.trainer import pack

    caps = [Capture(i, torch.zeros(5, dtype=torch.long, device="meta"), torch.ones(5, dtype=torch.long, device="meta"),
                    torch.zeros(5, 3, 4, device="meta"), torch.zeros(5, 4, device="meta")) for i in range(2)]
    row = pack(caps)
    assert {t.device.type for t in (row.input_ids_T, row.doc_ids_T, row.position_ids_T)} == {"meta"}
