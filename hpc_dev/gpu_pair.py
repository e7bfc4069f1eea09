"""`scripts/gpu-check --gpus 2`: what one GPU cannot show, on a machine with two.

Two ranks, each on its own GPU over NCCL (with `--device cpu`, two processes over gloo, the
same code): DDP keeps two trainers' weights identical while each trains on its own data, and
the verifier -> trainer stream runs over the NCCL data plane against a raw send of the same
bytes, as `dspark bench stream --backend nccl` measures it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hpc.dist.planes import init_planes, rank_device
from hpc.dist.rendezvous import new_secret
from hpc.launch.plan import capacity_plan
from hpc.net import free_port
from hpc.stream import stream_bench as bench
from hpc_dev.gpu_checks import Row, sync
from hpc_dev.gpu_trainer import build_trainer, config_for, receive_pool, sample

STREAM_RATIO_GOAL = 0.9  # issue 28's goal for the stream against a raw send, and data-wait below
STREAM_WAIT_GOAL = 0.05
DDP_STEPS = 3
MEMORY_TOLERANCE = 0.15  # as the one-GPU train-step rows: the plan's per-GPU figure, either way


def _ddp_rank(rank: int, d: dict, dev_type: str, port: int, secret: str, out: str) -> None:
    """One trainer of two: a few DDP steps on this rank's own samples, then the weights' digest."""
    torch.set_num_threads(1)
    device = rank_device(dev_type, local=rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    planes = init_planes(rank, 2, [0, 1], backend, device, "127.0.0.1", port, secret, timeout_s=300)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            trainer, cfg = build_trainer(d, device, Path(tmp), planes=planes)
            held = receive_pool(cfg, device)  # as the plan counts it
            before = _digest(trainer.model)
            seq, anchors = d["steps"][0]
            trainer.cfg.max_anchors = anchors
            stream_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
            times, losses, rows = [], [], 0
            for i in range(DDP_STEPS):
                mb = sample(d, seq, device, stream_dtype, 1000 * rank + i)  # each rank its own rows
                rows += sum(int(c.input_ids_T.sum()) for c in mb.mine)
                t0 = time.perf_counter()
                losses.append(trainer.step([mb])["loss"])
                sync(device)
                times.append(time.perf_counter() - t0)
                if i == 0 and device.type == "cuda":  # DDP's buckets exist from the first backward on
                    torch.cuda.reset_peak_memory_stats(device)
            after = _digest(trainer.model)
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
            del held
        pc = config_for(d, seq)  # the plan for two trainer ranks: DDP's gradient buckets counted
        pc.train.ranks_per_node, pc.train.global_batch_size, pc.train.max_anchors = 2, 2, anchors
        if device.type == "cpu":
            pc.train.device, pc.train.dtype = "cpu", "float32"
        plan = capacity_plan(pc).trainer_gpu_bytes
        mine = torch.tensor(after, dtype=torch.float64)
        both = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(both, mine, group=planes.train_control)  # host tensors: the control plane
        Path(f"{out}.{rank}").write_text(json.dumps({
            "same": bool(torch.equal(both[0], both[1])), "moved": after != before, "losses": losses, "rows": rows,
            "step_s": statistics.median(times[1:]) if len(times) > 1 else times[0], "peak_bytes": peak,
            "plan_bytes": plan}))
    finally:
        dist.destroy_process_group()


def _digest(model: torch.nn.Module) -> list[float]:
    """Sums that differ unless every weight is equal (bit for bit on one device type)."""
    s = s2 = 0.0
    for p in model.parameters():
        f = p.detach().double()
        s += float(f.sum())
        s2 += float((f * f).sum())
    return [s, s2]


def check_ddp_pair(d: dict, dev: torch.device) -> Row:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "ddp")
        mp.start_processes(_ddp_rank, args=(d, dev.type, free_port(), new_secret(), out), nprocs=2,
                           start_method="spawn")
        ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1)]
    same = all(r["same"] for r in ranks)
    moved = all(r["moved"] for r in ranks)
    # Each rank trained on its own rows: equal weights then mean DDP averaged the two gradients.
    # (The reported loss is already the mean over ranks, the same on both.)
    own_data = ranks[0]["rows"] != ranks[1]["rows"]
    finite = all(x == x and abs(x) != float("inf") for r in ranks for x in r["losses"])
    backend = "nccl" if dev.type == "cuda" else "gloo"
    seq, anchors = d["steps"][0]
    memory = "memory judged on GPUs (the CPU tracker does not see DDP's C++ buckets)"
    fits = True
    if dev.type == "cuda":  # the allocator's peak includes DDP's buckets; plan within 15% either way
        ratios = [r["peak_bytes"] / r["plan_bytes"] for r in ranks]
        fits = all(abs(x - 1) <= MEMORY_TOLERANCE for x in ratios)
        memory = f"peak vs plan {', '.join(f'{x:.2f}x' for x in ratios)} (within {MEMORY_TOLERANCE:.0%}: {fits})"
    ok = same and moved and own_data and finite and fits
    return Row("DDP (2 ranks)", "PASS" if ok else "FAIL",
               f"{backend}, {DDP_STEPS} steps of {seq} x {anchors} on each rank's own rows: weights identical "
               f"on both ranks: {same}; moved from init: {moved}; rows differ per rank: {own_data}; "
               f"{memory}; {ranks[0]['step_s']:.2f} s/step", {"ranks": ranks})


def check_stream_pair(dev: torch.device, small: bool) -> Row:
    """The stream over two ranks' data plane against a raw send of the same bytes (medians)."""
    p = argparse.ArgumentParser()
    bench.add_args(p)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    shape = ["--tokens", "512", "--hidden", "256", "--samples", "8"] if small else ["--preset", "kimi"]
    args = p.parse_args(["--backend", backend, "--repeats", "3", *shape])
    cases, measured = bench.measure(args)
    case, res = cases[0], measured[0]
    raw_s, stream_s = statistics.median(res["raw"]), statistics.median(res["stream"])
    ratio, wait = raw_s / stream_s, statistics.median(res["wait"])
    per = bench.case_bytes(case)
    gbps = case["samples"] * per / stream_s / 1e9
    # On CPU the row passes when both ranks ran the stream and the raw loop to the end under the
    # NCCL-rules checker (a failure raises: a FAIL row); the goals are judged where they mean
    # something, two GPUs over NCCL: tests never assert timings.
    ok = (ratio >= STREAM_RATIO_GOAL and wait <= STREAM_WAIT_GOAL) if dev.type == "cuda" else True
    return Row("NCCL stream (2 ranks)", "PASS" if ok else "FAIL",
               f"{backend}, {per / 1e6:,.1f} MB samples: stream {gbps:.2f} GB/s, {ratio:.2f}x a raw send "
               f"(goal >= {STREAM_RATIO_GOAL}), data-wait {wait:.1%} (goal <= {STREAM_WAIT_GOAL:.0%})"
               + ("" if dev.type == "cuda" else "; goals judged on GPUs only"),
               {"ratio": ratio, "wait": wait, "bytes": per, "gbps": gbps})
