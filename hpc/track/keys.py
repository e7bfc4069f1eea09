"""The MLflow tag and metric keys that one module writes and another reads back.

A key spelt twice drifts: the writer renames it and the reader silently finds nothing. So the
keys that cross modules live here, and writers and readers both import them.
"""

from __future__ import annotations

# --- MLflow's own run tags -----------------------------------------------------------------
PARENT_RUN_ID = "mlflow.parentRunId"  # a stage run's parent: the pipeline run
RUN_NAME = "mlflow.runName"

# --- every run of a pipeline (hpc.track.pipeline.common_tags) -------------------------------
STAGE = "dspark.stage"  # one of the STAGE_* values below, or a stage table name
CONFIG_HASH = "dspark.config_hash"  # the resolved config: one training variant
CONFIG_NAME = "dspark.config_name"
OUTCOME = "dspark.outcome"  # on the pipeline run: why it ended as it did

# Values of STAGE that a reader selects runs by.
STAGE_PIPELINE = "pipeline"  # the parent run
STAGE_TRAIN = "train"
STAGE_EVAL = "eval"  # one (draft, n) eval run
STAGE_BASELINE = "baseline"  # one measured baseline, reused across evals
STAGE_EVAL_ADAPTIVE = "eval_adaptive"  # adaptive verification against fixed n (hpc.evaluate.adaptive_job)
STAGE_SERVING = "serving"  # the champion as served: one point per `dspark watch` tick (hpc.watch)
CHAMPION_VERSION = "dspark.champion"  # on a serving run: "MODEL vN", the version it watches

# --- eval and baseline runs (hpc.evaluate.runner writes, compare/record/pipeline read) -------
SPEC_N = "dspark.n"  # num_speculative_tokens
DRAFT = "dspark.draft"  # the draft's label
DRAFT_SHA256 = "dspark.draft_sha256"
METHOD = "dspark.method"  # the vLLM speculative method
ENGINE = "dspark.engine"
ENGINE_VERSION = "dspark.engine_version"
VLLM_VERSION = "dspark.vllm_version"
HARDWARE = "dspark.hardware"
TEMPERATURE = "dspark.temperature"
TIMING = "dspark.timing"
CONFIDENCE = "dspark.confidence"  # how the reference engine read the confidence head (eval.confidence)
BASELINE_KEY = "dspark.baseline_key"  # what a cached baseline was measured on
MANIFESTS = "dspark.manifests"  # JSON {benchmark: prompts sha256}; also on registered versions

# --- eval metrics (hpc.evaluate.record writes, compare reads) --------------------------------
MEAN = "mean"  # the benchmark slot of the means over benchmarks


def metric(benchmark: str, name: str) -> str:
    """An eval run's metric key: `gsm8k/tok_s`, `mean/accept_len`; `name` is a BenchResult field."""
    return f"{benchmark}/{name}"


MEAN_ACCEPT_LEN = metric(MEAN, "accept_len")
MEAN_SPEEDUP = metric(MEAN, "speedup")
