"""Typed configuration of a dspark-hpc pipeline.

Every size, device, dtype and backend lives here, so the same code runs Kimi-K2.6 on H200
nodes and the toy target on a laptop CPU. Defaults are the published kimi-k2.6-dspark
recipe; `configs/*.yaml` override them and `dspark validate` checks the result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hpc.formats.draft_args import DraftArgs, LossArgs


class FinalHidden(str, Enum):
    """Which last hidden state the verifier capture returns."""

    post_norm = "post_norm"  # after the target's final RMSNorm: what the lm_head sees
    pre_norm = "pre_norm"  # output of the last decoder layer, before the final norm


class VerifierBackend(str, Enum):
    vllm = "vllm"
    hf = "hf"  # in-process transformers, for CPU runs and small targets


class EvalEngine(str, Enum):
    auto = "auto"  # vLLM, except DSpark drafts where the vLLM build cannot decode them (CPU)
    vllm = "vllm"
    reference = "reference"  # hpc.evaluate.reference: exact greedy spec decoding in torch


class ConfidenceFold(str, Enum):
    # The decoding mode whose survival the calibrate stage fits the one affine map to that it
    # folds into the exported head: vLLM serves that head for every request, greedy or sampled.
    greedy = "greedy"
    sampling = "sampling"
    none = "none"  # serve the raw head


class ServedConfidence(str, Enum):
    # What the reference engine decodes with. served: the exported head alone (the fold in its
    # weights), as vLLM computes it. side_file: the per-position maps of confidence_calibration.json,
    # which vLLM does not read.
    served = "served"
    side_file = "side_file"


class EvalTiming(str, Enum):
    # paired: every benchmark alternates baseline and draft requests on the same prompts, on the
    # same engine build and node, and reports the speedup's spread. cached: one baseline per
    # (target, build, hardware, manifests), reused from MLflow; for targets whose baseline
    # server cannot run beside the draft's (Kimi fills a node), at the price of an unknown spread.
    paired = "paired"
    cached = "cached"


class Trigger(str, Enum):
    """What makes a scheduled tick submit a retrain."""

    cron = "cron"  # the training data changed since the last scheduled run
    drift = "drift"  # the served draft's live acceptance fell below the line (serve.*)
    both = "both"


class Schedule(str, Enum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


@dataclass
class ClusterConfig:
    """Where jobs run. Roles get whole nodes: verifier nodes hand all their GPUs to vLLM."""

    executor: str = "slurm"  # slurm | local (submitit's local executor, for the CPU demo)
    partition: str = "gpu"
    account: str | None = None
    qos: str | None = None
    time: str = "48:00:00"
    verifier_nodes: int = 1
    trainer_nodes: int = 1
    eval_nodes: int = 1  # one: an eval job's every task would run the whole evaluation
    regenerate_nodes: int = 1  # a Ray cluster over these nodes, one vLLM server on each
    ray_object_store_mb: int = 512  # per node; regeneration moves only text through it
    gpus_per_node: int = 8
    # The GPU model (h100, h200, b200, ...) or its compute capability (9.0, sm100): validate asks
    # the installed vLLM's source what it runs there (eval.adaptive's attention backend).
    gpu: str | None = None
    cpus_per_task: int = 16
    # Whole nodes by default: vLLM, the pinned stream buffers and /dev/shm all count against the
    # job's memory cgroup, and another job's kernels on a verifier GPU would stall its all-reduces.
    exclusive: bool = True  # --exclusive; false lets other jobs share the node
    mem: str | None = "0"  # --mem: "0" is the node's whole memory; null leaves the partition's default
    signal_delay_s: int = 90  # --signal=USR2@90: ranks checkpoint before preemption (dspark plan sizes it)
    sbatch_extra: list[str] = field(default_factory=list)
    log_dir: str = "runs/slurm"  # must be on a filesystem every node sees


@dataclass
class VerifierConfig:
    """The target model and how it is served while we capture its hidden states."""

    model: str = "moonshotai/Kimi-K2.6"  # a local directory, or a hub id resolved to a snapshot
    revision: str | None = None  # pin a hub id to a commit (recommended) or tag
    # None: the environment decides (HF_HUB_OFFLINE); true/false overrides it for our processes.
    offline: bool | None = None
    # The target's name in exports and baseline keys; set by the launcher to the hub id when it
    # replaces `model` with the local snapshot. None: `model`.
    name: str | None = None
    tokenizer: str | None = None  # defaults to `model`
    trust_remote_code: bool = True
    backend: VerifierBackend = VerifierBackend.vllm
    # Used when the target's config.json is not reachable from the login node.
    num_hidden_layers: int = 61
    hidden_size: int = 7168
    vocab_size: int = 163840
    # vLLM/speculators convention: id i is the INPUT of decoder layer i (HF hidden_states[i]).
    aux_layer_ids: list[int] = field(default_factory=lambda: [1, 29, 57])
    final_hidden: FinalHidden = FinalHidden.post_norm
    tensor_parallel_size: int = 8
    max_model_len: int = 20480  # above data.max_seq_len: a capture generates one token past the row
    dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    python: str = "python3"  # interpreter of the venv vLLM lives in
    # validate asks that vLLM what it serves (hpc/verifier/vllm_probe.py, cached); false where the
    # login node cannot run the compute nodes' venv, at the price of learning it in the job
    probe: bool = True
    entrypoint: str = "vllm.entrypoints.openai.api_server"
    host: str = "127.0.0.1"
    # Our vLLM servers serve only this node's own clients; another address is refused unless
    # this is true (the servers still require their per-server API key).
    allow_remote_host: bool = False
    port: int = 0  # 0: a free port per server (a fixed one can be taken by another user first)
    extra_args: list[str] = field(default_factory=list)
    # fuse_allreduce_rms breaks CUDA-graph capture under spec-decode token expansion.
    compilation_config: dict[str, Any] = field(
        default_factory=lambda: {"pass_config": {"fuse_allreduce_rms": False}}
    )
    env: dict[str, str] = field(default_factory=dict)
    # Node-local directory (RAM) under which each capture server makes its own 0700 directory.
    capture_dir: str = "/dev/shm"
    # Capture requests in flight per verifier node, so vLLM batches prefills; None: what
    # `dspark plan` recommends for the data's sample length.
    capture_concurrency: int | None = None
    health_timeout_s: float = 1800.0
    # A capture that only ran out of time while the server still answers /health (a loaded
    # server, a long prefill) is tried again for this long; then the sample is skipped, and a
    # skipped sample is never trained.
    capture_retry_s: float = 600.0


class SourceKind(str, Enum):
    rows = "rows"  # a dataset: every row, as it is
    # prompts the serving stack logged (hpc/data/traffic.py): JSONL chat rows with a timestamp,
    # each conversation once, only the last max_age_days before `until`
    traffic = "traffic"


@dataclass
class DataSource:
    path: str = ""  # a Hugging Face dataset id, or a local .jsonl/.parquet file or directory
    split: str = "train"
    max_rows: int | None = None
    kind: SourceKind = SourceKind.rows
    max_age_days: float = 7.0  # traffic: how far back from `until` rows count
    # traffic: the window's end (ISO 8601). None: the time `dspark submit` runs, which it writes
    # here, so every stage of one pipeline reads the same rows however long it queues.
    until: str | None = None

    def settings(self) -> list:
        """What decides the rows this source reads: the identity of prepared and regenerated data."""
        base = [self.path, self.split, self.max_rows]
        kind = self.kind.value if isinstance(self.kind, Enum) else str(self.kind)
        return base if kind == SourceKind.rows.value else [*base, kind, self.max_age_days, self.until]


@dataclass
class DataConfig:
    sources: list[DataSource] = field(
        default_factory=lambda: [DataSource(path="mlabonne/open-perfectblend")]
    )
    # Rows of the serving distribution (e.g. `dspark calibration-set`: benchmark rows no eval
    # reads) that train nobody: the calibrate stage fits the confidence calibration on them, after
    # regenerating them as data.sources are. Empty: it fits on train.hold_out_every's rows.
    calibration_sources: list[DataSource] = field(default_factory=list)
    regenerate: bool = True  # regenerate assistant turns with the target (on-policy data)
    regen_temperature: float = 0.0
    regen_max_tokens: int = 4096
    regen_concurrency: int = 8  # requests in flight per vLLM server (it batches them)
    output_dir: str = "runs/data"
    max_seq_len: int = 20000
    # Vocabulary pruning keeps this many target ids; one value, owned by the draft.
    draft_vocab_size: int = "${draft.draft_vocab_size}"  # type: ignore[assignment]
    seed: int = 0


@dataclass
class TrainConfig:
    lr: float = 3e-4
    schedule: Schedule = Schedule.cosine
    warmup_steps: int = 300
    min_lr_ratio: float = 0.0
    # On rows the target regenerated greedily, the share of a sample's positions where its argmax
    # from the captured state is the next token must reach this, or the run stops
    # (hpc/train/integrity.py). Not 1: a reply decoded and tokenized again need not give the ids
    # the target generated (the DeepSeek toy agreed on 69%, Qwen3's on 99%); a broken capture on 0-5%.
    min_teacher_agreement: float = 0.25
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    global_batch_size: int = 8
    grad_accumulation: int = 2
    steps: int = 20000
    max_anchors: int = 3072
    loss: LossArgs = field(default_factory=LossArgs)  # the loss's own class (hpc.formats.draft_args)
    apply_verifier_norm: bool = False
    # The draft lm_head starts as the verifier's lm_head rows of the draft vocab; speculators
    # keeps it frozen there, which is the default here too.
    train_lm_head: bool = False
    checkpoint_interval: int = 500
    keep_checkpoints: int = 3
    output_dir: str = "runs/train"
    seed: int = 0
    device: str = "cuda"
    dtype: str = "bfloat16"  # autocast dtype on GPU; CPU runs use float32
    dist_backend: str = "nccl"  # gloo on CPU: same code path
    attention: str = "auto"  # auto | flex | sdpa
    # Trainer processes per trainer node; None means one per GPU (cluster.gpus_per_node).
    ranks_per_node: int | None = None
    # Every N-th prepared row (sample id % N == N - 1) trains nobody: the calibrate stage fits the
    # confidence head's calibration on those rows after training. 0: nothing held out, no stage.
    hold_out_every: int = 0
    # Warm start for a fresh run (a resumed run keeps its checkpoint): a draft export directory,
    # or `champion` = the registry's champion of tracking.registered_model.
    init_from: str | None = None


@dataclass
class StreamConfig:
    """Verifier -> trainer hidden-state streaming over torch.distributed point-to-point."""

    dtype: str = "auto"  # auto: bfloat16 with NCCL, float32 with gloo (CPU training is fp32)
    buffer_per_trainer: int = 8  # samples a trainer may have in flight: the backpressure bound
    prefetch: int = 2  # captures a streamer prepares ahead of the network
    # Samples on the wire per streamer -> trainer pair: with one, each sample waits for the last
    # to land (bench stream: about half a raw send); two keep the link busy. On a verifier node
    # they sit on vLLM's last GPU: the streamer holds at most what fits in vLLM's headroom.
    in_flight: int = 2
    heartbeat_s: float = 2.0
    peer_timeout_s: float = 30.0  # a silent peer is declared dead after this long
    # The data plane's (NCCL's) and DDP's op timeout: a dead or hung peer surfaces in minutes, with
    # a flight-recorder dump. Data ops are posted only when their data is due, so no healthy wait
    # (a vLLM start, a slow trainer) runs on it; the gloo control plane keeps the long timeout.
    nccl_timeout_s: float = 300.0


@dataclass
class ThirdPartyDraft:
    name: str = ""
    method: str = "eagle3"  # any vLLM speculative method
    model: str = ""
    revision: str | None = None  # pin a hub id to a commit: vLLM loads (and may run) that draft's files


@dataclass
class CostCurves:
    """Adaptive verification's step costs, as vLLM profiles them: [[size, ms], ...] with sizes
    increasing. verify_ms: a verify step's time over the tokens it verifies (one per request plus
    the admitted drafts); draft_ms: the drafter's time over the requests drafted. Empty: measured
    on the engine the evaluation runs."""

    verify_ms: list[list[float]] = field(default_factory=list)
    draft_ms: list[list[float]] = field(default_factory=list)


# The published card's benchmarks, in its row order: the one list that validation, the eval
# harness (one manifest each, hpc/formats/manifests), compare and the reports read.
BENCHMARKS = ("gsm8k", "math500", "aime", "humaneval", "livecodebench", "speedbench_coding")


@dataclass
class EvalConfig:
    benchmarks: list[str] = field(default_factory=lambda: list(BENCHMARKS))
    num_speculative_tokens: list[int] = field(default_factory=lambda: [3, 7])
    max_tokens: int = 2048
    code_max_tokens: int = 512  # livecodebench and speedbench_coding, as on the card
    rows: int | None = None  # None: 6 for the small sets, full manifests for code sets
    # > 0: every draft is evaluated at temperature 0 AND at this temperature (speculative
    # sampling), side by side; the sampled requests are seeded from eval.seed.
    temperature: float = 0.0
    seed: int = 0
    timing: EvalTiming = EvalTiming.paired
    timing_min_pairs: int = 6  # baseline/draft request pairs per benchmark (passes repeat the prompts)
    compare: list[ThirdPartyDraft] = field(default_factory=list)
    data_dir: str | None = None  # offline clusters: {data_dir}/{benchmark}.jsonl|.parquet
    datasets: dict[str, str] = field(default_factory=dict)  # per benchmark: local JSONL/parquet path
    fixtures: bool = False  # the prompts the project ships (CPU tests, demos): not the real sets
    engine: EvalEngine = EvalEngine.auto
    device: str = "cpu"  # the reference engine's device
    # Calibration report: the share of a verify step one more drafted token costs; it turns
    # "expected accepted tokens" into a choice of n and confidence threshold.
    draft_token_cost: float = 0.03
    fold: ConfidenceFold = ConfidenceFold.greedy
    confidence: ServedConfidence = ServedConfidence.served
    # A third evaluation job beside the fixed n's: vLLM's adaptive verification (the global top-k
    # of survival under a cost-table budget), at each concurrency, against fixed n at the same costs.
    adaptive: bool = False
    adaptive_concurrency: list[int] = field(default_factory=lambda: [1, 8, 32])
    adaptive_cost: CostCurves = field(default_factory=CostCurves)
    output_dir: str = "runs/eval"
    # The draft's column on the card. None: DSpark, or DFlash for a draft in DFlash's layout. A
    # pipeline names each variant of its sweep (`lr=0.001`) or ablation (`Markov-only`), so one
    # card shows them side by side instead of the last one under "DSpark".
    label: str | None = None


@dataclass
class TrackingConfig:
    uri: str = "sqlite:///runs/mlflow.db"
    # `dspark submit` runs many jobs that write at once; a SQLite (or file) store on a shared
    # filesystem does not survive that, so it wants an http server (`dspark tracking serve`).
    allow_file_store: bool = False
    experiment: str = "dspark"
    registered_model: str = "kimi-k2.6-dspark"


@dataclass
class ServeConfig:
    """The vLLM servers that serve the champion, as `dspark watch` reads them (hpc/watch)."""

    endpoints: list[str] = field(default_factory=list)  # base URLs; each one's /metrics is read
    # The endpoints' bearer token (a gateway's, say): the NAME of an environment variable, or a
    # file only you can read. Never the token itself: config values reach MLflow params and argv.
    token_env: str | None = None
    token_file: str | None = None
    allow_http: bool = False  # send that token over plain http (a network you trust)
    num_speculative_tokens: int | None = None  # the n they serve; None: eval's largest
    # Drift: live tau below drift_ratio x the champion's evaluated tau for `window` ticks in a
    # row, over at least min_drafts drafts; then no second retrain for `cooldown` (Slurm time).
    drift_ratio: float = 0.9
    window: int = 3
    min_drafts: int = 1000
    cooldown: str = "1-00:00:00"
    timeout_s: float = 5.0  # per endpoint: one that does not answer is left out of the tick
    state_dir: str = "runs/watch"  # the counters a tick reads its deltas against


@dataclass
class ScheduleConfig:
    cron: str | None = None
    trigger: Trigger = Trigger.cron
    warm_start_from_champion: bool = True
    # Every evaluation at the largest n registers its draft; false leaves the champion alias to
    # a person, e.g. while the benchmarks are being changed.
    promote_if_better: bool = True
    # A tick resubmits a pipeline that FAILED on unchanged data this many times in a row, then
    # waits for new data (or a person): a failure that always recurs must not take an allocation
    # every tick.
    retries: int = 2


@dataclass
class SubmitConfig:
    # A sweep expands into one array task per combination: 40 x 40 x 40 values would validate
    # for minutes and queue 64,000 trainings. Above this many, validate refuses the sweep.
    max_variants: int = 256
    # One allocation trains every variant of the sweep from one verifier's capture (V verifier
    # nodes + a group of trainer_nodes per variant) instead of an allocation per variant: a
    # verifier's GPU-hours are spent once. A variant may not change what is captured
    # (hpc/config/shared_sweep.py). `dspark train` shares the same way on one machine.
    share_verifier: bool = False
    # The equal-budget ablations (`dspark submit CONFIG --ablations`): DSpark, DFlash and
    # Markov-only trained from one capture stream (so the verifier is shared), each evaluated, and
    # the card's equal-budget table. The base config is the DSpark draft; no sweep beside it.
    ablations: bool = False


@dataclass
class PlanConfig:
    """Knobs of `dspark plan`, the capacity planner: facts about the target and the hardware
    that the rest of the config does not hold. Estimates; measure and set the Optional ones."""

    target_params_b: float = 1000.0  # total target parameters, billions (Kimi-K2.6: ~1T, MoE)
    target_active_params_b: float = 32.0  # parameters active per token, billions: prefill FLOPs
    target_bytes_per_param: float = 2.0  # bytes per stored parameter: 2 for bf16; Kimi's INT4 experts: ~0.6 overall
    prefill_tok_s_per_node: float | None = None  # verifier prefill tok/s per node; None: from active params and FLOPs
    gpu_tflops: float = 989.0  # dense bf16 TFLOP/s per GPU (H200)
    mfu: float = 0.35  # model FLOPs utilisation assumed for prefill and for draft training
    link_gbps: float = 400.0  # verifier -> trainer network per node, gigabit/s (one NDR port)
    trainer_step_samples_s_per_gpu: float | None = None  # trainer samples/s per GPU; None: from the draft's FLOPs
    gpu_memory_gb: float = 141.0  # per GPU (H200)
    avg_seq_len: int | None = None  # tokens per sample; None: data.max_seq_len / 2
    # The pipeline's time (hpc/launch/plan_time.py). None: a modelled figure, which plan labels so.
    source_rows: int | None = None  # rows of each data.sources entry without max_rows; None: unknown
    regen_tokens_per_row: float | None = None  # tokens regenerated per row; None: data.regen_max_tokens
    regen_tok_s_per_server: float | None = None  # a regeneration server's decode tok/s, all its requests
    decode_tok_s_per_stream: float | None = None  # one request's decode tok/s (eval); None: 110
    target_load_s: float | None = None  # a vLLM start with the target; None: 120 s + weights / fs_gbytes_s
    fs_gbytes_s: float | None = None  # filesystem GB/s (checkpoints, weights); None: 0.5
    # Share of the verifier's prefill lost because the streamer shares vLLM's last GPU (time-sliced
    # without MPS; gpu-check's time-slicing row measures it on a GPU). None: assumed 0.
    timeslice_slowdown: float | None = None


# draft.* key -> the verifier.* key it follows: the target's dims, one value each (validate
# refuses another).
DRAFT_FROM_VERIFIER = {"hidden_size": "hidden_size", "target_hidden_size": "hidden_size",
                       "target_vocab_size": "vocab_size", "aux_layer_ids": "aux_layer_ids"}


@dataclass
class DSparkConfig:
    name: str = "kimi-k2.6-dspark"
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    # The draft's own class (hpc.formats.draft_args, the format of its config.json); here its target dims follow verifier.*.
    draft: DraftArgs = field(default_factory=lambda: DraftArgs(
        **{key: f"${{verifier.{source}}}" for key, source in DRAFT_FROM_VERIFIER.items()}))  # type: ignore[arg-type]
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    stream: StreamConfig = field(default_factory=StreamConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    submit: SubmitConfig = field(default_factory=SubmitConfig)
    # One training array task per combination, e.g. {"train.lr": [3e-4, 1e-4]}.
    sweep: dict[str, list[Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Built in code (tests, gpu-check) rather than loaded, the schema's interpolations are
        # still strings: give them the values OmegaConf would.
        for key, source in DRAFT_FROM_VERIFIER.items():
            if isinstance(getattr(self.draft, key), str):
                setattr(self.draft, key, getattr(self.verifier, source))
        if isinstance(self.data.draft_vocab_size, str):
            self.data.draft_vocab_size = self.draft.draft_vocab_size
