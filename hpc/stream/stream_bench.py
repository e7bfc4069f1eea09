"""`dspark bench stream`: streamer -> trainer throughput against a raw torch.distributed send of
the same bytes between the same two processes, and the trainer's data-wait fraction.

Also a user tool: on a GPU allocation, `--backend nccl` measures the real verifier-to-trainer
link before a long run. Captures are synthetic (no verifier compute), so the figure is the
transport's ceiling; repeats alternate raw and stream, and medians are reported.
`--preset sizes` runs the three sizes the goal names in one run: 8.4 MB, 33.6 MB and a
Kimi-K2.6 sample (20k tokens x 7168 x 4 states in bf16, 1.15 GB), or the largest this
machine's memory holds with every buffer the bench keeps.

`--groups K`: one streamer feeds K trainers, each the group of one draft (a sweep sharing the
verifier): every sample goes to all K, staged once. The peer is then K raw sends of the same
bytes, one to each trainer in turn, and the data-wait is the worst trainer's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hpc.dist.planes import init_planes, open_pairs, rank_device
from hpc.dist.rendezvous import new_secret
from hpc.dist.rules import Message, handover, message
from hpc.dist.streams import RecvStream
from hpc.net import free_port
from hpc.stream.protocol import BufferPool, sample_bytes
from hpc.stream.receiver import StreamReceiver
from hpc.stream.sample import Capture
from hpc.stream.streamer import run_streamer
from hpc.tables import text_table


def _capture(i: int, T: int, n_aux: int, H: int, dtype: torch.dtype):
    """A capture in the stream dtype, as a bf16 verifier's would be: no cast on the way."""
    g = torch.Generator().manual_seed(i)
    return Capture.from_states(i, torch.randint(0, 1000, (T,), generator=g), torch.ones(T, dtype=torch.long),
                               torch.randn(T, n_aux + 1, H, generator=g).to(dtype))


def _raw(planes, n: int, T: int, n_aux: int, H: int, dtype: torch.dtype) -> float:
    """Seconds to move n samples' tensors to every trainer with plain blocking send/recv on the
    data plane, one trainer after the other (the streamer is the last rank)."""
    # The same bytes as a sample, in one tensor each way: the best a transport can do.
    ids = planes.empty(2, T, dtype=torch.int64).zero_()
    states = planes.empty(T, n_aux + 1, H, dtype=dtype).zero_()
    streamer = len(planes.trainers)
    dist.barrier(group=planes.control)
    t0 = time.perf_counter()
    with message(Message.SAMPLE):
        for _ in range(n):
            if planes.rank == streamer:
                for t in planes.trainers:
                    dist.send(ids, dst=t, group=planes.data)
                    dist.send(states, dst=t, group=planes.data)
            else:
                with RecvStream(planes.device) as side:
                    dist.recv(ids, src=streamer, group=planes.data)
                    dist.recv(states, src=streamer, group=planes.data)
                    side.synchronize()
    _sync(planes.device)
    dist.barrier(group=planes.control)
    _hand_over(planes)  # the stream's own threads take the pairs next
    return time.perf_counter() - t0


def _hand_over(planes) -> None:
    streamer = len(planes.trainers)
    for peer in (planes.trainers if planes.rank == streamer else [streamer]):
        handover(planes.data, peer)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # NCCL ops return once queued: time what has arrived
        torch.cuda.synchronize(device)


def _stream(planes, n: int, case: dict, dtype: torch.dtype, step_s: float, buffer: int,
            in_flight: int, pool=None) -> tuple[float, float, int]:
    """(seconds for n samples through streamer + receiver, the trainer's wait fraction after the
    first sample, the streamer's peak host bytes in flight). `pool`: the trainer's receive
    buffers, kept warm across runs as a training run keeps them."""
    T, A, H = case["tokens"], case["n_aux"], case["hidden"]
    streamer = len(planes.trainers)
    # Two distinct captures, sent in turn: a Kimi-size sample is 1.15 GB.
    caps = [_capture(i, T, A, H, dtype) for i in range(2)] if planes.rank == streamer else []
    dist.barrier(group=planes.control)
    t0 = time.perf_counter()
    wait, host = 0.0, 0
    if planes.rank == streamer:
        def rows(ledger: list[list[int]], epoch: int) -> Iterator[tuple[int, int, list[int], list[int]]]:
            return ((0, i, [], []) for i in range(n))

        stats = run_streamer(rows, lambda i, ids, mask: _renamed(caps[i % 2], i), planes, dtype, prefetch=2,
                             heartbeat_s=5.0, in_flight=in_flight, groups=[[t] for t in planes.trainers])
        host = stats.sender.peak_host_bytes if stats.sender is not None else 0
    else:
        recv = StreamReceiver([streamer], buffer, planes, peer_timeout_s=120.0, pool=pool).start(
            [], 0, share_ledger=True)
        first = None
        while (item := recv.get()) is not None:
            if first is None:  # the steady state: the wait for the pipeline's first sample is not a stall
                first, recv.wait_s = time.perf_counter(), 0.0
            recv.consumed(item[0])
            recv.release(item[2])
            if step_s:
                time.sleep(step_s)  # a trainer step that takes this long
        wait = recv.wait_s / max(time.perf_counter() - (first or t0), 1e-9)
    _sync(planes.device)
    dist.barrier(group=planes.control)
    _hand_over(planes)
    return time.perf_counter() - t0, wait, host


def _renamed(cap, i: int):
    return Capture.from_states(i, cap.input_ids_T, cap.loss_mask_T, cap.packed_states())


def worker(rank: int, args: dict, port: int, secret: str, out: str) -> None:
    torch.set_num_threads(1)
    # Ranks 0..K-1 are the trainers (one per group), rank K the streamer: each on its own GPU with
    # NCCL (one node, K + 1 GPUs).
    k = args["groups"]
    device = rank_device("cuda" if args["backend"] == "nccl" else "cpu", local=rank, exclusive=True)
    planes = init_planes(rank, k + 1, list(range(k)), args["backend"], device, args["addr"], port, secret)
    open_pairs(planes)
    results = []
    for case in args["cases"]:
        dtype = getattr(torch, case["dtype"])
        T, A, H, n = case["tokens"], case["n_aux"], case["hidden"], case["samples"]
        raw, stream, waits, host = [], [], [], 0
        pool = BufferPool(device, limit=args["buffer"]) if rank < k else None
        _raw(planes, 2, T, A, H, dtype)  # warm up the connection at this size, and the pool below
        _stream(planes, min(n, args["buffer"]), case, dtype, 0.0, args["buffer"], args["in_flight"], pool)
        for _ in range(args["repeats"]):
            raw.append(_raw(planes, n, T, A, H, dtype))
            s, _, h = _stream(planes, n, case, dtype, 0.0, args["buffer"], args["in_flight"], pool)
            stream.append(s)
            host = max(host, h)
            # Demand below supply: every step's worth of data should already be waiting.
            step_s = max(args["step_ms"] / 1000, 1.25 * statistics.median(raw) / n)
            waits.append(_stream(planes, n, case, dtype, step_s, args["buffer"], args["in_flight"], pool)[1])
        results.append({"raw": raw, "stream": stream, "wait": waits, "step_s": step_s, "host": host})
    Path(f"{out}.{rank}").write_text(json.dumps(results))
    dist.destroy_process_group()


PRESETS = {  # (tokens, hidden, n_aux, dtype, samples)
    "8mb": (1024, 512, 3, "float32", 64),
    "33mb": (4096, 512, 3, "float32", 32),
    "kimi": (20000, 7168, 3, "bfloat16", 8),
}


def _cases(args: argparse.Namespace) -> list[dict]:
    if args.preset is None:
        return [{"tokens": args.tokens, "hidden": args.hidden, "n_aux": args.n_aux, "dtype": args.dtype,
                 "samples": args.samples}]
    names = ["8mb", "33mb", "kimi"] if args.preset == "sizes" else [args.preset]
    cases = []
    for name in names:
        T, H, A, dt, n = PRESETS[name]
        if name == "kimi":
            T = _largest_tokens(T, H, A, dt, args)
        cases.append({"tokens": T, "hidden": H, "n_aux": A, "dtype": dt, "samples": n})
    return cases


def _largest_tokens(T: int, H: int, A: int, dtype: str, args: argparse.Namespace) -> int:
    """Kimi's tokens, or fewer when this machine cannot hold every sample-sized buffer the bench
    keeps: the trainer's pool, the streamer's window and its two captures, in half of free RAM."""
    if args.backend == "nccl":
        return T
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return T
    held = args.buffer * args.groups + args.in_flight + 2 + 1
    per = sample_bytes(T, A, H, getattr(torch, dtype))
    if held * per <= free / 2:
        return T
    return max(1024, int(T * free / 2 / (held * per)) // 1024 * 1024)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    p.add_argument("--preset", choices=["sizes", *PRESETS], default=None,
                   help="sizes: 8.4 MB, 33.6 MB and a Kimi-K2.6 sample in one run (overrides --tokens etc.)")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per sample")
    p.add_argument("--hidden", type=int, default=512, help="target hidden size (Kimi: 7168)")
    p.add_argument("--n-aux", type=int, default=3)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--buffer", type=int, default=8, help="stream.buffer_per_trainer")
    p.add_argument("--in-flight", type=int, default=2, help="stream.in_flight: samples on the wire per trainer")
    p.add_argument("--step-ms", type=float, default=50.0,
                   help="simulated trainer step for the wait fraction (at least 1.25x a raw send)")
    p.add_argument("--groups", type=int, default=1,
                   help="K trainers, one per draft, each fed every sample (sweep.share_verifier); the peer "
                        "is K raw sends")
    p.add_argument("--addr", default="127.0.0.1")


def case_bytes(case: dict) -> int:
    return sample_bytes(case["tokens"], case["n_aux"], case["hidden"], getattr(torch, case["dtype"]))


def measure(args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """(the cases, per case trainer 0's timings with the worst trainer's data-wait and the
    streamer's host peak as "host"): K + 1 spawned ranks, ranks 0..K-1 the trainers and rank K the
    streamer (`scripts/gpu-check --gpus 2` runs K = 1)."""
    cases = _cases(args)
    k = getattr(args, "groups", 1)
    cfg = {"backend": args.backend, "repeats": args.repeats, "buffer": args.buffer, "in_flight": args.in_flight,
           "step_ms": args.step_ms, "addr": args.addr, "cases": cases, "groups": k}
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        mp.start_processes(worker, args=(cfg, free_port(), new_secret(), out), nprocs=k + 1, start_method="spawn")
        ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(k + 1)]
    trainers, streamer = ranks[:k], ranks[k]
    out_cases = []
    for i, sres in enumerate(streamer):
        res = dict(trainers[0][i])
        # each repeat's worst trainer: the group the streamer kept waiting longest
        res["wait"] = [max(t[i]["wait"][r] for t in trainers) for r in range(len(res["wait"]))]
        out_cases.append({**res, "host": sres["host"]})
    return cases, out_cases


def run(args: argparse.Namespace) -> int:
    if args.groups < 1:
        print(f"--groups {args.groups}: must be at least 1 (the trainers fed every sample)", file=sys.stderr)
        return 2
    if args.in_flight < 1 or args.in_flight > args.buffer:
        print(f"--in-flight {args.in_flight}: must be 1..--buffer ({args.buffer}); a trainer grants no more "
              "credits than its buffer", file=sys.stderr)
        return 2
    cases, measured = measure(args)
    k = args.groups
    fan = f", {k} groups: each sample to {k} trainers, against {k} raw sends" if k > 1 else ""
    print(f"stream bench: {args.backend}, {args.repeats} repeats (medians), {args.in_flight} in flight per "
          f"trainer, receive buffer {args.buffer}{fan}")
    rows = []
    for case, res in zip(cases, measured, strict=True):
        per = case_bytes(case)
        nbytes = case["samples"] * per * k  # on the streamer's links
        raw_s, stream_s = statistics.median(res["raw"]), statistics.median(res["stream"])
        rows.append([f"{per / 1e6:,.1f} MB", f"{case['tokens']}x{case['n_aux'] + 1}x{case['hidden']} {case['dtype']}",
                     f"{nbytes / raw_s / 1e9:.3f}", f"{nbytes / stream_s / 1e9:.3f}", f"{raw_s / stream_s:.2f}",
                     f"{statistics.median(res['wait']):.1%} at {res['step_s'] * 1e3:.0f} ms",
                     f"{res['host'] / 1e9:.2f} GB ({res['host'] / per:.1f} samples)"])
    print("\n".join(text_table(["sample", "shape", "raw GB/s", "stream GB/s", "ratio (goal >= 0.9)",
                                 "data-wait after 1st (goal <= 5%)", "streamer host in flight"], rows, right={2, 3, 4})))
    return 0
