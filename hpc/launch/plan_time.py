"""`dspark plan`'s pipeline time: each stage's wall-clock, the Slurm --time it needs and its
GPU-hours, and the preemption window node 0 must fit in cluster.signal_delay_s.

The capacity plan (hpc.launch.plan) gives the rates it computes: prefill per verifier node and
training samples/s. The rest are facts a login node cannot know: the filesystem's bandwidth,
vLLM's load of the target, one request's decode rate, the rows a hub dataset holds. Each is a
`plan.*` key: set, the figure is measured; unset (None), a modelled figure below stands in, and
every row says which. `dspark validate` refuses what this arithmetic says cannot finish: a stage
longer than cluster.time (training alone resumes across it), a preemption window shorter than
what node 0 must do in it, a regeneration of an unknown number of rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from hpc.config.checker import Checker
from hpc.config.schema import DataSource, DSparkConfig
from hpc.formats.benchmarks import load_manifest
from hpc.formats.slurm_time import parse_slurm_time
from hpc.model.inventory import BUFFER_ITEMSIZE, draft_shapes

GB = 1e9

# Modelled figures: each stands in until its plan.* key holds a measurement.
FS_GBYTES_S = 0.5  # an H200 node's local NVMe measured 0.78 GB/s; shared filesystems are often slower
DECODE_TOK_S = 110.0  # one request's decode on Kimi-K2.6 (TP=8, H200), no speculation
VLLM_START_S = 120.0  # a vLLM start besides reading the weights: imports, KV-cache profiling, CUDA graphs
REPORT_S = 60.0  # the report stage reads MLflow and writes a table
STREAMER_STOP_S = 10.0  # the trainers' STOP to each streamer and its answer: a few control messages
REQUEUE_S = 10.0  # `scontrol requeue` and the job's exit behind it
# hpc.proc.SubprocessServer.stop_grace, held equal by tests/launch/test_plan.py: importing hpc.proc
# would cost every `validate` psutil's import.
VLLM_STOP_GRACE_S = 15.0
# SIGTERM, SIGKILL after the grace, then up to 10 s for the group to go (hpc.proc.stop_group)
VLLM_SHUTDOWN_S = VLLM_STOP_GRACE_S + 10.0
WINDOW_MARGIN = 1.5  # the window's parts are modelled: the signal delay must clear them with room
FORWARD_SHARE = 1 / 3  # a forward pass costs 2 of training's 6 FLOPs per parameter and token


class Rates(Protocol):
    """What the capacity plan found (hpc.launch.plan.Plan)."""

    avg_seq_len: int
    prefill_tok_s: float
    prefill_estimated: bool
    trainer_samples_s_per_gpu: float
    trainer_estimated: bool
    cluster_supply_samples_s: float
    cluster_demand_samples_s: float
    run_hours: float


@dataclass
class Figure:
    value: float
    key: str  # the plan.* key a measurement goes in
    measured: bool

    @property
    def tag(self) -> str:
        return "measured" if self.measured else "modelled"


@dataclass
class StageTime:
    name: str  # the job's name, as `dspark status` lists it (eval-n3)
    seconds: float | None  # None: unknown, `how` says why
    nodes: int
    gpus: int  # the job's GPUs: nodes x cluster.gpus_per_node
    how: str
    allocations: int | None = None  # training only: it requeues itself at the signal and resumes

    @property
    def gpu_hours(self) -> float:
        return self.gpus * (self.seconds or 0.0) / 3600


@dataclass
class PipelineTime:
    inputs: list[tuple[str, str, str]]  # (what, value, how)
    stages: list[StageTime]
    time: str  # cluster.time as written
    limit_s: float | None  # cluster.time in seconds; None: unlimited
    window: list[tuple[str, float, str]]  # the preemption window's parts: (what, seconds, how)
    window_s: float  # what cluster.signal_delay_s must be: the parts x WINDOW_MARGIN
    signal_delay_s: int
    checkpoint_bytes: float
    problems: list[str]  # what `dspark validate` refuses, one line each


def checkpoint_bytes(cfg: DSparkConfig) -> tuple[float, float]:
    """(draft, optimizer) bytes of one checkpoint as hpc/train/checkpoint.py writes it: every
    tensor of the draft's state_dict in fp32, its two index buffers at their own width, and
    AdamW's exp_avg and exp_avg_sq (fp32) for every trainable parameter. The JSON state and the
    ranks' RNG files add kilobytes to a few MB (the epoch's ledger)."""
    model = optimizer = 0.0
    for name, shape in draft_shapes(cfg).items():
        n = math.prod(shape)
        if name in BUFFER_ITEMSIZE:
            model += n * BUFFER_ITEMSIZE[name]
            continue
        model += 4 * n
        frozen = name == "embed_tokens.weight" or (name == "lm_head.weight" and not cfg.train.train_lm_head)
        optimizer += 0 if frozen else 8 * n
    return model, optimizer


def rows_needed(cfg: DSparkConfig) -> int:
    """Rows the training reads: train.steps x global batch, plus the 1 in hold_out_every it keeps out."""
    t = cfg.train
    samples = t.steps * t.global_batch_size
    every = t.hold_out_every
    return math.ceil(samples * every / (every - 1)) if every > 1 else samples


def _rows(sources: list[DataSource], fallback: int | None) -> tuple[int, list[int]]:
    """(rows of the sources whose count is known, indexes of those whose count is not)."""
    known = [s.max_rows if s.max_rows is not None else fallback for s in sources]
    return sum(n for n in known if n is not None), [i for i, n in enumerate(known) if n is None]


def _figure(value: float | None, modelled: float, key: str) -> Figure:
    return Figure(modelled if value is None else float(value), key, value is not None)


def _duration(seconds: float) -> str:
    return (f"{seconds:.1f} s" if seconds < 60 else f"{seconds / 60:.1f} min" if seconds < 3600
            else f"{seconds / 3600:.1f} h")


def _size(n: float) -> str:
    return next((f"{n / s:.2f} {u}" for s, u in ((1e12, "TB"), (GB, "GB"), (1e6, "MB")) if n >= s), f"{n / 1e3:.2f} KB")


def slurm_time(seconds: float) -> str:
    """The --time that holds `seconds`, in Slurm's D-HH:MM:SS, whole minutes up."""
    minutes = math.ceil(seconds / 60)
    days, rest = divmod(minutes, 24 * 60)
    hm = f"{rest // 60:02d}:{rest % 60:02d}:00"
    return f"{days}-{hm}" if days else hm


def _eval_work(cfg: DSparkConfig, decode: Figure) -> tuple[int, float, float | None, str]:
    """(servers started, seconds generating, the adaptive job's seconds generating or None, how) of one
    eval job (hpc.evaluate.runner): each draft (ours and eval.compare's) at each temperature on a
    server of its own, single-stream, every request running to its max_tokens; a baseline server
    per temperature beside them (paired: alternating with each draft's requests, passes repeating
    the prompts up to eval.timing_min_pairs; cached: measured once, unless MLflow holds one)."""
    e = cfg.eval
    benches = []
    for name in e.benchmarks:
        m = load_manifest(name)
        rows = e.rows if e.rows is not None else m.rows if m.rows is not None else m.expected_rows or 0
        benches.append((rows, e.code_max_tokens if m.code else e.max_tokens))
    tokens = sum(r * mt for r, mt in benches)
    temps = 2 if e.temperature > 0 else 1
    runs = (1 + len(e.compare)) * temps
    if getattr(e.timing, "value", e.timing) == "paired":
        per_run = sum(2 * math.ceil(e.timing_min_pairs / r) * r * mt for r, mt in benches if r)
        generated, how = runs * per_run, f"{runs} draft run(s), each beside the baseline (paired)"
    else:
        generated, how = (runs + temps) * tokens, f"{runs} draft run(s) + {temps} baseline run(s) (cached)"
    adaptive = None
    if e.adaptive:  # hpc.evaluate.adaptive_job: each fixed n and adaptive on a server, at each concurrency
        prompts = sum(r for r, _ in benches)
        servers = len(set(e.num_speculative_tokens)) + 1
        adaptive = servers * sum(tokens / (min(r, prompts or 1) * decode.value) for r in set(e.adaptive_concurrency))
    how += (f" of {sum(r for r, _ in benches)} prompts, {tokens:,} tokens at max_tokens / {decode.value:g} tok/s "
            f"({decode.tag})")
    return runs + temps, generated / decode.value, adaptive, how


def pipeline_time(cfg: DSparkConfig, rates: Rates) -> PipelineTime:
    p, c, d, t, e = cfg.plan, cfg.cluster, cfg.data, cfg.train, cfg.eval
    fs = _figure(p.fs_gbytes_s, FS_GBYTES_S, "plan.fs_gbytes_s")
    decode = _figure(p.decode_tok_s_per_stream, DECODE_TOK_S, "plan.decode_tok_s_per_stream")
    server = _figure(p.regen_tok_s_per_server, d.regen_concurrency * decode.value, "plan.regen_tok_s_per_server")
    per_row = _figure(p.regen_tokens_per_row, d.regen_max_tokens, "plan.regen_tokens_per_row")
    weights_gb = p.target_params_b * p.target_bytes_per_param
    load = _figure(p.target_load_s, VLLM_START_S + weights_gb / fs.value, "plan.target_load_s")
    model_b, opt_b = checkpoint_bytes(cfg)
    write_s = (model_b + opt_b) / GB / fs.value
    minutes = parse_slurm_time(c.time)
    limit = None if minutes is None else minutes * 60.0
    gpn, checks = c.gpus_per_node, Checker()
    need = rows_needed(cfg)

    rows, unknown = _rows(d.sources, p.source_rows)
    cal_rows, cal_unknown = _rows(d.calibration_sources, None)
    said_rows = f"data.sources[].max_rows{' or plan.source_rows (measured)' if p.source_rows is not None else ''}"
    rows_note = said_rows + (f" + {cal_rows:,} calibration rows" if d.calibration_sources else "")
    if d.sources and all(s.max_rows is not None for s in d.sources) and rows < need:
        key = "data.sources[0].max_rows" if len(d.sources) == 1 else "data.sources[*].max_rows (their sum)"
        rows_note += f"; BELOW the {need:,} the training reads"
        share = f", and 1 row in train.hold_out_every={t.hold_out_every} held out" if t.hold_out_every > 1 else ""
        checks.fail(key, rows, f"below the {need:,} rows training reads (train.steps x train.global_batch_size = "
                    f"{t.steps * t.global_batch_size:,} samples{share}); raise it, or lower train.steps")
    missing = [f"data.sources[{i}].max_rows" for i in unknown] + [f"data.calibration_sources[{i}].max_rows"
                                                                  for i in cal_unknown]
    inputs = [
        ("rows", "unknown" if missing else f"{rows + cal_rows:,}", f"unknown: set {missing[0]}" if missing else rows_note),
        ("tokens per regenerated row", f"{per_row.value:,.0f}",
         f"{per_row.tag}: one reply running to data.regen_max_tokens ({per_row.key})"),
        ("decode per request", f"{decode.value:,.0f} tok/s",
         f"{decode.tag}: one request, no speculation; Kimi-K2.6 at TP=8 on H200 ({decode.key})"),
        ("regeneration per server", f"{server.value:,.0f} tok/s",
         f"{server.tag}: data.regen_concurrency={d.regen_concurrency} requests, each at decode per request; lower "
         f"at large batches ({server.key})"),
        ("filesystem", f"{fs.value:g} GB/s",
         f"{fs.tag}: an H200 node's NVMe measured 0.78 GB/s, shared filesystems are often slower ({fs.key})"),
        ("target load", _duration(load.value),
         f"{load.tag}: {VLLM_START_S:.0f} s vLLM start + {weights_gb:,.4g} GB of weights / filesystem ({load.key})"),
        ("checkpoint", _size(model_b + opt_b),
         f"draft {_size(model_b)} (every tensor, fp32) + AdamW {_size(opt_b)} (2 x fp32 per trainable "
         f"param); written in {_duration(write_s)} at the filesystem's rate ({fs.tag})"),
    ]

    def fits(seconds: float) -> str:
        if limit is None:
            return f"--time={slurm_time(seconds)}, cluster.time {c.time}"
        return f"{'fits' if seconds <= limit else 'OVER'} --time={slurm_time(seconds)} vs cluster.time {c.time}"

    stages: list[StageTime] = []
    if d.regenerate:
        n = c.regenerate_nodes
        if missing:
            stages.append(StageTime("regenerate", None, n, n * gpn, f"unknown: set {missing[0]} (or plan.source_rows)"))
            where = d.sources[unknown[0]].path if unknown else d.calibration_sources[cal_unknown[0]].path
            fix = f"set {missing[0]}" + (f" (the training reads {need:,} rows) or plan.source_rows" if unknown else "")
            checks.fail(missing[0], None, f"data.regenerate=true regenerates every row of {where}, which a login node "
                        f"cannot count, so the stage's time is unknown; {fix}")
        else:
            s = load.value + (rows + cal_rows) * per_row.value / (n * server.value)
            stages.append(StageTime("regenerate", s, n, n * gpn, f"{fits(s)}; {rows + cal_rows:,} rows x "
                                    f"{per_row.value:,.0f} tok ({per_row.tag}) / ({n} server(s) x "
                                    f"{server.value:,.0f} tok/s ({server.tag})) + target load ({load.tag})"))

    # Training: the signal (cluster.signal_delay_s before the limit) checkpoints and requeues it
    # (hpc.launch.stages.train_allocation), so it spans allocations; each loads the target again.
    n_ckpt = math.ceil(t.steps / t.checkpoint_interval)
    work = rates.run_hours * 3600 + n_ckpt * write_s
    usable = math.inf if limit is None else limit - load.value - c.signal_delay_s
    trained = "modelled" if rates.prefill_estimated or rates.trainer_estimated else "measured"
    nodes = c.verifier_nodes + c.trainer_nodes
    how = (f"time for train.steps {_duration(rates.run_hours * 3600)} "
           f"({trained}) + {n_ckpt} checkpoints x {_duration(write_s)} + target load ({load.tag}) per allocation")
    if usable <= 0:
        stages.append(StageTime("train", None, nodes, nodes * gpn, f"never trains: {how}"))
        checks.fail("cluster.time", c.time, f"stage train: an allocation ends before training starts (target load "
                    f"{_duration(load.value)} + cluster.signal_delay_s={c.signal_delay_s}); raise cluster.time")
    else:
        k = max(1, math.ceil(work / usable)) if limit is not None else 1
        s = work + k * load.value + (k - 1) * write_s
        span = (f"{k} allocations of cluster.time {c.time}, requeued at the signal" if k > 1
                else f"{fits(s)} (a longer run resumes in another allocation)")
        stages.append(StageTime("train", s, nodes, nodes * gpn, f"{span}; {how}", k))

    if (t.hold_out_every > 0 or d.calibration_sources) and cfg.draft.enable_confidence_head:
        held = (None if cal_unknown else cal_rows) if d.calibration_sources else (
            None if unknown else rows // t.hold_out_every)
        if held is None:
            key = missing[len(unknown)] if d.calibration_sources else missing[0]
            stages.append(StageTime("calibrate", None, 1, gpn, f"unknown: set {key}"))
        else:
            prefill = held * rates.avg_seq_len / rates.prefill_tok_s
            draft = held * FORWARD_SHARE / rates.trainer_samples_s_per_gpu
            s = load.value + prefill + draft
            stages.append(StageTime("calibrate", s, 1, gpn, f"{fits(s)}; {held:,} rows, one at a time: prefill "
                                    f"{_duration(prefill)} ({'modelled' if rates.prefill_estimated else 'measured'}) "
                                    f"+ the draft's forward {_duration(draft)} "
                                    f"({'modelled' if rates.trainer_estimated else 'measured'}) + target load "
                                    f"({load.tag})"))

    servers, decode_s, adaptive_s, eval_how = _eval_work(cfg, decode)
    en, egpus = c.eval_nodes, c.eval_nodes * gpn
    for n in e.num_speculative_tokens:
        s = servers * load.value + decode_s
        stages.append(StageTime(f"eval-n{n}", s, en, egpus, f"{fits(s)}; {servers} target loads + {eval_how}"))
    if adaptive_s is not None:
        k = len(set(e.num_speculative_tokens)) + 1
        s = k * load.value + adaptive_s
        stages.append(StageTime("eval-adaptive", s, en, egpus, f"{fits(s)}; {k} servers (each fixed n, adaptive), "
                                f"each over every prompt at eval.adaptive_concurrency "
                                f"{sorted(set(e.adaptive_concurrency))}, decode per request ({decode.tag})"))
    stages.append(StageTime("report", REPORT_S, 1, 0, f"{fits(REPORT_S)}; modelled: reads MLflow"))

    fixes = {"regenerate": "raise cluster.regenerate_nodes or data.regen_concurrency, lower data.sources[].max_rows",
             "calibrate": "hold out fewer rows (a larger train.hold_out_every, or fewer calibration rows)",
             "eval-adaptive": "fewer eval.adaptive_concurrency levels, a lower eval.max_tokens or eval.rows"}
    for st in stages:
        if st.seconds is not None and st.name != "train" and limit is not None and st.seconds > limit:
            fix = fixes.get(st.name, "a lower eval.max_tokens or eval.rows, fewer eval.compare drafts")
            checks.fail("cluster.time", c.time, f"stage {st.name} needs {_duration(st.seconds)} "
                        f"(--time={slurm_time(st.seconds)}) and does not resume after its time limit; {fix}, "
                        "or raise cluster.time")

    # Preemption: node 0 must finish all of this between the signal and the job's end.
    supply = min(rates.cluster_supply_samples_s, rates.cluster_demand_samples_s)
    window = [
        ("reach a step boundary", t.global_batch_size / supply, "one step: train.global_batch_size / min(supply, demand)"),
        ("write the checkpoint", write_s, f"{_size(model_b + opt_b)} / {fs.value:g} GB/s ({fs.tag})"),
        ("streamer STOP", STREAMER_STOP_S, "modelled: the trainers' STOP to each streamer, and its answer"),
        ("vLLM shutdown", VLLM_SHUTDOWN_S,
         f"SIGTERM, SIGKILL after {VLLM_STOP_GRACE_S:g} s, its processes gone (hpc.proc.stop_group)"),
        ("requeue", REQUEUE_S, "modelled: scontrol requeue, and the job's exit"),
    ]
    window_s = WINDOW_MARGIN * sum(s for _, s, _ in window)
    if c.signal_delay_s < window_s:
        parts = " + ".join(f"{what} {_duration(s)}" for what, s, _ in window)
        checks.fail("cluster.signal_delay_s", c.signal_delay_s, f"shorter than the {window_s:.0f} s node 0 needs between "
                    f"the signal and the job's end: {WINDOW_MARGIN:g} x ({parts}); set cluster.signal_delay_s="
                    f"{math.ceil(window_s)} or more (Slurm allows up to 65535)")
    return PipelineTime(inputs, stages, c.time, limit, window, window_s, c.signal_delay_s, model_b + opt_b,
                        checks.problems)


def critical_path(pt: PipelineTime) -> float:
    """Wall-clock from the first job's start to the report's end, queue waits aside: the stages
    run one behind another, except the eval jobs, which run side by side."""
    evals = [s.seconds or 0.0 for s in pt.stages if s.name.startswith("eval")]
    return sum(s.seconds or 0.0 for s in pt.stages if not s.name.startswith("eval")) + max(evals, default=0.0)


def _gpu_hours(h: float) -> str:
    return f"{h:,.0f} GPU-h" if h >= 10 else f"{h:.2g} GPU-h"


def pipeline_sections(pt: PipelineTime) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """`dspark plan`'s sections for the pipeline, rows of (what, value, how) as the others are."""
    unknown = [s.name for s in pt.stages if s.seconds is None]
    total_how = (f"{_gpu_hours(sum(s.gpu_hours for s in pt.stages))}; the stages one behind another, the evals side by "
                 "side; queue waits not counted" + (f"; {', '.join(unknown)} unknown, left out" if unknown else ""))
    stage_rows = [(s.name, "unknown" if s.seconds is None else _duration(s.seconds),
                   f"{s.nodes} node(s), " + (f"{_gpu_hours(s.gpu_hours)}; " if s.gpus else "no GPU; ") + s.how)
                  for s in pt.stages]
    verdict = "fits" if pt.signal_delay_s >= pt.window_s else "SHORT: validate refuses"
    return [
        ("pipeline inputs (measured: its plan.* key is set; modelled: set it from a measurement)", pt.inputs),
        ("pipeline time (one Slurm job per row)", [*stage_rows, ("total", _duration(critical_path(pt)), total_how)]),
        ("preemption window (node 0, from the signal to the job's end)", [
            *[(what, _duration(s), how) for what, s, how in pt.window],
            ("needed", f"{pt.window_s:.0f} s",
             f"{WINDOW_MARGIN:g} x the parts; {verdict} cluster.signal_delay_s = {pt.signal_delay_s} s"),
        ]),
    ]
