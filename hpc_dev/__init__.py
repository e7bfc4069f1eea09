"""Development tooling: the CPU proving ground that stands in for a GPU cluster.

- `devcluster*`: a real 3-node Slurm cluster on one host (munge, slurmdbd + MariaDB, fake GPU gres);
- `toy*`: the tiny Qwen3/DeepseekV3-shaped target models, trained on local text;
- `offline`: single-process training with an in-process verifier (tests, ablations, parity);
- `demo`, `bench_acceptance`, `capture_bench`, `toy_bench`, `bench_speculators`: what runs on it;
- `speculators_env`: the venv of the peer implementation the train-step bench measures against;
- `gpu_checks`: scripts/gpu-check's checks of the data path (planes, stream buffers, capture copy).

- `cli`: the `dspark-dev` command (`demo`, `devcluster`, `toy-target`, the dev benchmarks).

`hpc` (the production package) never names this package, not even as a string, and a cluster's
`pip install .` does not install it: it is its own distribution (`hpc_dev/pyproject.toml`),
which the repository's setup installs beside `hpc`. tests/test_layers.py enforces both.
"""
