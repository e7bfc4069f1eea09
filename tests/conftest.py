"""Shared test plumbing: the session fixtures for real infrastructure live in tests/fixtures/."""

import torch

pytest_plugins = [
    "tests.fixtures.infra",
    "tests.fixtures.slurm",
    "tests.fixtures.mlflow",
    "tests.fixtures.toy",
    "tests.fixtures.vllm",
]

# The CI machine has 2 cores shared with Slurm, MLflow and vLLM daemons (and the tests' own
# rank processes): a 2-thread OpenMP pool spin-waiting against them runs small matmuls up to
# 50x slower. One intra-op thread per process keeps timings sane and reproducible.
torch.set_num_threads(1)
