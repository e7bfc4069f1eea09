"""The configured verifier backend, as a capture function: what a streamer rank and the
calibrate stage ask for the target's hidden states."""

from __future__ import annotations

import os
from pathlib import Path

from hpc.config.schema import DSparkConfig
from hpc.verifier.hf_backend import HFVerifier
from hpc.verifier.vllm_backend import VLLMVerifier
from hpc.verifier.vllm_support import default_capture_concurrency


def capture_concurrency(cfg: DSparkConfig) -> int:
    """Capture requests in flight: the config's, else the plan's recommendation (HF: one, it is not thread-safe)."""
    if cfg.verifier.backend.value == "hf":
        return 1
    if cfg.verifier.capture_concurrency:
        return cfg.verifier.capture_concurrency
    return default_capture_concurrency(cfg.plan.avg_seq_len or max(cfg.data.max_seq_len // 2, 1))


def make_capture(cfg: DSparkConfig, device: str, log_dir: Path):
    """(capture, closer): the backend's capture function, and what stops its server (None for HF)."""
    v = cfg.verifier
    if v.backend.value == "hf":
        hf = HFVerifier(v.model, list(v.aux_layer_ids), v.final_hidden.value, device=device,
                        trust_remote_code=v.trust_remote_code)
        return hf.capture, None
    # A capture that times out means a hung server, unless /health says otherwise (then it is that
    # sample's failure). Request + health probe + exit wait stay within stream.peer_timeout_s, so
    # a hung verifier is reported as soon as the trainers' watchdog would call a streamer dead.
    peer = cfg.stream.peer_timeout_s
    verifier = VLLMVerifier(cfg.verifier, log_path=log_dir / f"vllm-verifier-{os.getpid()}.log",
                            request_timeout_s=0.6 * peer, file_timeout_s=0.6 * peer, probe_timeout_s=0.25 * peer)
    return verifier.capture, verifier
