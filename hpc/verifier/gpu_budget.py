"""What the streamer puts on a verifier node's last GPU, beside vLLM's last tensor-parallel rank.

vLLM takes `verifier.gpu_memory_utilization` of every GPU it runs on; the streamer (one process
per verifier node, hpc.launch.stages) lives in what is left of the last one. It holds a CUDA
context, the data plane's NCCL communicator with a p2p connection to every trainer rank, and the
sample it is sending. Torch-free: `dspark plan` shows it and `validate` refuses a config where
it does not fit, on the login node.
"""

from __future__ import annotations

from hpc.config.schema import DSparkConfig

GB = 1e9
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Checked on a GPU by scripts/gpu-check's "streamer footprint" row, with NVML. On one H200 (torch
# 2.11, CUDA 13, 2026-12-04) it read a 0.75 GB context and 0.85 GB for a one-rank communicator with
# one p2p connection, against the 0.6 and 0.55 first assumed here: these are that run, rounded up.
CUDA_CONTEXT_BYTES = 0.8 * GB  # a process's CUDA context with the cuBLAS/NCCL kernels loaded
NCCL_COMM_BYTES = 0.85 * GB  # the data plane's communicator with its first p2p connection
NCCL_PEER_BYTES = 0.05 * GB  # p2p buffers per trainer rank (NCCL_BUFFSIZE x channels, both ways)


def stream_dtype_name(cfg: DSparkConfig) -> str:
    """The dtype the streamers send hidden states in: the config's, else bf16 over NCCL and fp32 over
    gloo (a name: the login node sizes the stream without torch)."""
    if cfg.stream.dtype != "auto":
        return cfg.stream.dtype
    return "bfloat16" if cfg.train.dist_backend == "nccl" else "float32"


def largest_sample_bytes(cfg: DSparkConfig) -> int:
    v = cfg.verifier
    return cfg.data.max_seq_len * (len(v.aux_layer_ids) + 1) * v.hidden_size * DTYPE_BYTES[stream_dtype_name(cfg)]


def _fixed_items(cfg: DSparkConfig, trainer_ranks: int) -> list[tuple[str, float, str]]:
    return [
        ("CUDA context", CUDA_CONTEXT_BYTES, "one process, kernels loaded (gpu-check measures it)"),
        ("NCCL communicator", NCCL_COMM_BYTES + trainer_ranks * NCCL_PEER_BYTES,
         f"the data plane + p2p buffers to {trainer_ranks} trainer ranks"),
    ]


def samples_in_flight(cfg: DSparkConfig, trainer_ranks: int) -> int:
    """The streamer's cap on samples on the wire at once: stream.in_flight to each trainer, as
    many as fit in vLLM's headroom beside the fixed items when it shares vLLM's GPU (never
    fewer than one trainer's window: `validate` refuses a config where that does not fit)."""
    want = cfg.stream.in_flight * max(trainer_ranks, 1)
    if not shares_gpu_with_vllm(cfg) or not 0 < cfg.verifier.gpu_memory_utilization < 1:
        return want
    free = headroom_bytes(cfg) - sum(b for _, b, _ in _fixed_items(cfg, trainer_ranks))
    return max(cfg.stream.in_flight, min(want, int(free // max(largest_sample_bytes(cfg), 1))))


def streamer_items(cfg: DSparkConfig, trainer_ranks: int) -> list[tuple[str, float, str]]:
    """(what, bytes, how) of the streamer's share of the last GPU."""
    n = samples_in_flight(cfg, trainer_ranks)
    return [*_fixed_items(cfg, trainer_ranks),
            ("samples on the GPU", n * largest_sample_bytes(cfg),
             f"{n} in flight x the largest sample (stream.in_flight={cfg.stream.in_flight} per trainer, "
             "capped by this headroom)")]


def headroom_bytes(cfg: DSparkConfig) -> float:
    """What vLLM leaves of the last GPU."""
    return (1 - cfg.verifier.gpu_memory_utilization) * cfg.plan.gpu_memory_gb * GB


def shares_gpu_with_vllm(cfg: DSparkConfig) -> bool:
    return cfg.train.dist_backend == "nccl" and cfg.verifier.backend.value == "vllm"
