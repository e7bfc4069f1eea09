"""Shared test plumbing: the session fixtures for real infrastructure live in tests/fixtures/."""

pytest_plugins = [
    "tests.fixtures.infra",
    "tests.fixtures.slurm",
    "tests.fixtures.mlflow",
    "tests.fixtures.toy",
    "tests.fixtures.vllm",
]
