"""A verifier node's last GPU holds two processes, vLLM's last tensor-parallel rank and our
streamer: in EXCLUSIVE_PROCESS compute mode the second to start would fail with a CUDA error
deep inside vLLM or NCCL. Checked once per node, before either starts, in one line."""

from __future__ import annotations

import os
import subprocess

from hpc.errors import UserError


def check_shared_gpu(index: int) -> None:
    """UserError if GPU `index` (as this node numbers it) refuses a second process."""
    try:
        proc = subprocess.run(["nvidia-smi", "-i", str(index), "--query-gpu=compute_mode", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return  # no NVIDIA tooling here: CUDA's own error will have to do
    mode = proc.stdout.strip()
    if proc.returncode == 0 and mode.lower().startswith("exclusive"):
        raise UserError(f"GPU {index} on {os.uname().nodename} is in {mode} compute mode, and a verifier node's "
                        "last GPU holds both vLLM's last tensor-parallel rank and the streamer; ask for GPUs in "
                        "Default mode (nvidia-smi -c DEFAULT, or the partition's gres setting), or set "
                        "verifier.tensor_parallel_size below cluster.gpus_per_node so the streamer has a GPU of its own")
