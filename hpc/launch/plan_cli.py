"""`dspark plan CONFIG`: the capacity plan as one table (hpc.launch.plan computes it)."""

from __future__ import annotations

import argparse

from hpc.launch.launch_checks import resolve
from hpc.launch.plan import IDS_BYTES_PER_TOKEN, Plan, capacity_plan
from hpc.launch.plan_time import pipeline_sections
from hpc.tables import text_table
from hpc.verifier.gpu_budget import DTYPE_BYTES


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return ""


def _duration(hours: float) -> str:
    return f"{hours:.1f} h" if hours >= 1 else f"{hours * 60:.1f} min"


def _rate(n: float) -> str:
    return f"{n:.3g}" if n < 1000 else f"{n:,.0f}"


def format_plan(pl: Plan) -> str:
    est = lambda flag: "estimated" if flag else "measured (plan.*)"  # noqa: E731
    sections: list[tuple[str, list[tuple[str, str, str]]]] = [
        ("stream payload", [
            ("bytes per captured token", _bytes(pl.bytes_per_token),
             f"({pl.n_aux} aux + 1 last) x {pl.hidden} hidden x {DTYPE_BYTES[pl.stream_dtype]} B ({pl.stream_dtype})"
             f" + {IDS_BYTES_PER_TOKEN} B ids/mask"),
            ("avg tokens per sample", str(pl.avg_seq_len), "plan.avg_seq_len (default data.max_seq_len / 2)"),
            ("bytes per sample", _bytes(pl.bytes_per_sample), "tokens x bytes per token + header"),
        ]),
        ("verifier supply (per verifier node)", [
            ("prefill", f"{_rate(pl.prefill_tok_s)} tok/s",
             f"{est(pl.prefill_estimated)}: tensor_parallel_size GPUs x TFLOP/s x mfu / (2 x active params)"),
            ("prefill-limited supply", f"{_rate(pl.prefill_samples_s)} samples/s", "prefill tok/s / avg tokens"),
            ("link capacity", f"{_rate(pl.link_samples_s)} samples/s",
             f"{_bytes(pl.link_bytes_s)}/s = plan.link_gbps / 8"),
            ("samples on the wire", f"{pl.in_flight} per trainer",
             f"stream.in_flight, at most {pl.in_flight_total} per streamer: the link stays busy only with 2 or more "
             "(`dspark bench stream --preset sizes` measures the ratio to a raw send)"),
            ("supply", f"{_rate(pl.supply_samples_s)} samples/s",
             ("LINK-BOUND: the network, not prefill, limits supply" if pl.link_bound
              else "prefill-bound: the link carries it") + f" ({_bytes(pl.supply_bytes_s)}/s on the wire)"),
            ("capture requests in flight", str(pl.capture_concurrency),
             "verifier.capture_concurrency" if pl.capture_concurrency_set else
             "recommended (verifier.capture_concurrency unset): 1 + 16384 batched tokens / avg tokens, 2..8"),
        ]),
        ("trainer demand (per trainer node)", [
            ("train FLOPs per sample", f"{pl.train_flops_per_sample:.3g} FLOP",
             f"6 x params x tokens + attention; {pl.block_tokens_per_sample:.0f} block tokens/sample"),
            ("per GPU", f"{_rate(pl.trainer_samples_s_per_gpu)} samples/s",
             f"{est(pl.trainer_estimated)}: TFLOP/s x mfu / FLOPs per sample"),
            ("demand", f"{_rate(pl.demand_samples_s)} samples/s",
             f"per GPU x {pl.ranks_per_node} ranks (of {pl.gpus_per_node} GPUs; micro-batch {pl.micro_batch}),"
             " link-capped"),
        ]),
        ("balance", [
            ("trainer nodes per verifier node", f"{pl.trainer_nodes_per_verifier_node:.2f}", "supply / demand"),
            ("recommended", f"{pl.recommend_verifier_nodes} verifier : {pl.recommend_trainer_nodes} trainer",
             "fewest node-seconds per trained sample"),
            ("configured", f"{pl.verifier_nodes} verifier : {pl.trainer_nodes} trainer",
             f"supply {_rate(pl.cluster_supply_samples_s)} vs demand {_rate(pl.cluster_demand_samples_s)} samples/s"),
            ("trainer data-wait", f"{pl.trainer_wait:.0%}", "max(0, 1 - supply / demand): trainers idle for data"),
            ("verifier throttle", f"{pl.verifier_throttle:.0%}",
             "max(0, 1 - demand / supply): backpressure idles prefill"),
            ("time for train.steps", _duration(pl.run_hours), "steps x global batch / min(supply, demand)"),
        ]),
        ("memory per trainer GPU", [(m.what, _bytes(m.bytes), m.how) for m in pl.trainer_memory] + [
            ("total", _bytes(pl.trainer_gpu_bytes),
             ("OVER: exceeds " if pl.trainer_over else "fits ") + f"plan.gpu_memory_gb = {_bytes(pl.gpu_bytes)}"),
        ]),
        ("verifier memory (its vLLM's GPUs)", [
            ("target weights", _bytes(pl.target_weight_bytes), "plan.target_params_b x plan.target_bytes_per_param"),
            ("GPU memory", _bytes(pl.verifier_node_bytes), "verifier.tensor_parallel_size x plan.gpu_memory_gb"),
            ("KV-cache headroom", _bytes(pl.kv_headroom_bytes),
             ("OVER: the target does not fit; " if pl.verifier_over else "")
             + "verifier.gpu_memory_utilization x GPU memory - weights"),
        ]),
    ]
    if pl.streamer_memory:
        need = sum(m.bytes for m in pl.streamer_memory)
        sections.append(("streamer on the verifier's last GPU (beside vLLM)", [
            *[(m.what, _bytes(m.bytes), m.how) for m in pl.streamer_memory],
            ("total", _bytes(need), ("OVER: exceeds " if need > pl.streamer_headroom_bytes else "fits ")
             + f"what vLLM leaves, {_bytes(pl.streamer_headroom_bytes)} = (1 - verifier.gpu_memory_utilization) "
             "x plan.gpu_memory_gb"),
            ("prefill lost to time-slicing", f"{pl.timeslice_slowdown:.0%}",
             "measured (plan.timeslice_slowdown)" if pl.timeslice_measured else
             "ASSUMED 0, not measured: without MPS the streamer's copies and NCCL kernels time-slice with vLLM's TP "
             "rank here; gpu-check's time-slicing row measures it on a GPU (set plan.timeslice_slowdown)"),
        ]))
    if pl.shared:
        sections.append(_shared_section(pl))
    sections += pipeline_sections(pl.pipeline) if pl.pipeline else []
    # One table for all sections, so their columns line up; each title then goes above its rows.
    table = iter(text_table(None, [r for _, rs in sections for r in rs], right={1}))
    lines = [f"{pl.name}: capacity plan (estimates; set plan.* to measured values to refine)"]
    for title, rs in sections:
        lines += ["", title] + ["  " + next(table) for _ in rs]
    return "\n".join(lines)


def _shared_section(pl: Plan) -> tuple[str, list[tuple[str, str, str]]]:
    sh = pl.shared
    assert sh is not None
    k, v, t = sh.variants, pl.verifier_nodes, pl.trainer_nodes
    saved = 1 - sh.gpu_hours / sh.solo_gpu_hours if sh.solo_gpu_hours else 0.0
    return (f"shared verifier ({sh.key}: {k} variants from one capture)", [
        ("bytes per sample on its link", _bytes(sh.bytes_per_sample), f"{k} copies: each sample to every variant"),
        ("link capacity", f"{_rate(sh.link_samples_s)} samples/s", f"per verifier node, at {k} copies"),
        ("supply", f"{_rate(sh.supply_samples_s)} samples/s",
         ("LINK-BOUND at this many copies" if sh.link_bound else "prefill-bound: the link carries every copy")
         + f"; the link feeds at most {sh.most_variants_link} variants at their demand"),
        ("each variant's demand", f"{_rate(sh.group_demand_samples_s)} samples/s",
         f"{t} trainer node(s); every variant takes every sample"),
        ("allocation", f"{sh.nodes} nodes", f"{v} verifier + {k} x {t} trainer, against {k} allocations of {v + t}"),
        ("time for train.steps", _duration(sh.run_hours),
         f"every variant at once; alone, each {_duration(sh.solo_run_hours)}"),
        ("train GPU-hours", f"{sh.gpu_hours:,.0f}",
         f"against {sh.solo_gpu_hours:,.0f} for {k} solo allocations: {saved:.0%} saved"),
    ])


def run(args: argparse.Namespace) -> int:
    cfg = resolve(args.config, args.overrides, check_tracking=False)
    print(format_plan(capacity_plan(cfg)))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="capacity plan: verifier supply vs trainer demand, trainer nodes per "
                                    "verifier node, memory per GPU, each stage's time")
    p.add_argument("config", help="YAML config, e.g. configs/kimi-k2.6-dspark.yaml")
    p.add_argument("overrides", nargs="*", help="KEY=VALUE overrides, e.g. plan.link_gbps=200")
    p.set_defaults(func=run)
