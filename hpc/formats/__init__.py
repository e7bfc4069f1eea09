"""The formats one stage writes and another reads, on the package graph's lowest floor.

Each is a file layout or a schema, not a stage: the draft's `config.json` args (`draft_args`),
the d2t/t2d vocab map (`vocab_map`), the confidence calibration maps (`calibration`), the
checkpoint layout (`checkpoint_layout`) and the benchmark manifests (`benchmarks`). They import
nothing of the package but `hpc.errors`, `hpc.fsio` and `hpc.hub`, and no torch at import: the login node
reads them in `validate`.
"""
