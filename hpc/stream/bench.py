"""`dspark bench stream`: streamer -> trainer throughput against a raw torch.distributed send of
the same bytes between the same two processes, and the trainer's data-wait fraction.

Also a user tool: on a GPU allocation, `--backend nccl` measures the real verifier-to-trainer
link before a long run. Captures are synthetic (no verifier compute), so the figure is the
transport's ceiling; repeats alternate raw and stream, and medians are reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist


def _capture(i: int, T: int, n_aux: int, H: int):
    from hpc.stream.sample import Capture

    g = torch.Generator().manual_seed(i)
    return Capture.from_states(i, torch.randint(0, 1000, (T,), generator=g), torch.ones(T, dtype=torch.long),
                               torch.randn(T, n_aux + 1, H, generator=g))


def _raw(planes, n: int, T: int, n_aux: int, H: int, dtype: torch.dtype) -> float:
    """Seconds to move n samples' tensors with plain blocking send/recv on the data plane."""
    from hpc.dist.rules import Message, handover, message

    # The same bytes as a sample, in one tensor each way: the best a transport can do.
    ids = torch.zeros(2, T, dtype=torch.int64, device=planes.device)
    states = torch.zeros(T, n_aux + 1, H, dtype=dtype, device=planes.device)
    dist.barrier(group=planes.control)
    t0 = time.perf_counter()
    with message(Message.SAMPLE):
        for _ in range(n):
            if planes.rank == 1:
                dist.send(ids, dst=0, group=planes.data)
                dist.send(states, dst=0, group=planes.data)
            else:
                dist.recv(ids, src=1, group=planes.data)
                dist.recv(states, src=1, group=planes.data)
    _sync(planes.device)
    dist.barrier(group=planes.control)
    handover(planes.data, 1 - planes.rank)  # the stream's own threads take the pair next
    return time.perf_counter() - t0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # NCCL ops return once queued: time what has arrived
        torch.cuda.synchronize(device)


def _stream(planes, n: int, T: int, n_aux: int, H: int, dtype: torch.dtype, step_s: float,
            buffer: int) -> tuple[float, float]:
    """(seconds for n samples through streamer + receiver, trainer wait fraction)."""
    from hpc.stream.receiver import StreamReceiver
    from hpc.stream.streamer import run_streamer

    caps = [_capture(i, T, n_aux, H) for i in range(n)] if planes.rank == 1 else []
    dist.barrier(group=planes.control)
    t0 = time.perf_counter()
    wait = 0.0
    if planes.rank == 1:
        def rows(ledger: list[list[int]], epoch: int) -> Iterator[tuple[int, int, list[int], list[int]]]:
            return ((0, c.sample_id, [], []) for c in caps)

        run_streamer(rows, lambda i, ids, mask: caps[i], planes, dtype, prefetch=4, heartbeat_s=5.0)
    else:
        recv = StreamReceiver([1], buffer, planes, peer_timeout_s=60.0).start([], 0, share_ledger=True)
        while (item := recv.get()) is not None:
            recv.consumed(item[0])
            recv.release(item[2])
            if step_s:
                time.sleep(step_s)  # a trainer step that takes this long
        wait = recv.wait_s
    _sync(planes.device)
    dist.barrier(group=planes.control)
    from hpc.dist.rules import handover

    handover(planes.data, 1 - planes.rank)
    elapsed = time.perf_counter() - t0
    return elapsed, wait / elapsed


def worker(rank: int, args: dict, port: int, secret: str, out: str) -> None:
    from hpc.dist.planes import init_planes, open_pairs, rank_device

    torch.set_num_threads(1)
    # Rank 0 is the trainer, rank 1 the streamer: each on its own GPU with NCCL (one node, 2 GPUs).
    device = rank_device("cuda" if args["backend"] == "nccl" else "cpu", local=rank, exclusive=True)
    planes = init_planes(rank, 2, [0], args["backend"], device, args["addr"], port, secret)
    open_pairs(planes)
    dtype = getattr(torch, args["dtype"])
    T, A, H, n = args["tokens"], args["n_aux"], args["hidden"], args["samples"]
    raw, stream, waits = [], [], []
    _raw(planes, 2, T, A, H, dtype)  # warm up the connection
    for _ in range(args["repeats"]):
        raw.append(_raw(planes, n, T, A, H, dtype))
        stream.append(_stream(planes, n, T, A, H, dtype, 0.0, args["buffer"])[0])
        # Demand below supply: every step's worth of data should already be waiting.
        waits.append(_stream(planes, n, T, A, H, dtype, args["step_ms"] / 1000, args["buffer"])[1])
    if rank == 0:
        Path(out).write_text(json.dumps({"raw": raw, "stream": stream, "wait": waits}))
    dist.destroy_process_group()


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per sample")
    p.add_argument("--hidden", type=int, default=512, help="target hidden size (Kimi: 7168)")
    p.add_argument("--n-aux", type=int, default=3)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--buffer", type=int, default=8, help="stream.buffer_per_trainer")
    p.add_argument("--step-ms", type=float, default=50.0, help="simulated trainer step for the wait fraction")
    p.add_argument("--addr", default="127.0.0.1")


def run(args: argparse.Namespace) -> int:
    import torch.multiprocessing as mp

    from hpc.dist.rendezvous import new_secret
    from hpc.net import free_port
    from hpc.tables import text_table

    cfg = {k: getattr(args, k) for k in ("backend", "tokens", "hidden", "n_aux", "dtype", "samples", "repeats",
                                         "buffer", "step_ms", "addr")}
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        mp.start_processes(worker, args=(cfg, free_port(), new_secret(), out), nprocs=2, start_method="spawn")
        res = json.loads(Path(out).read_text())
    elem = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    nbytes = args.samples * (args.tokens * 2 * 8 + args.tokens * (args.n_aux + 1) * args.hidden * elem)
    raw_s, stream_s = statistics.median(res["raw"]), statistics.median(res["stream"])
    wait = statistics.median(res["wait"])
    print(f"stream bench: {args.backend}, {args.samples} samples x {nbytes / args.samples / 1e6:.1f} MB, "
          f"{args.repeats} repeats (medians)")
    print("\n".join(text_table(None, [
        ["raw send", f"{nbytes / raw_s / 1e9:.3f} GB/s", ""],
        ["streamer", f"{nbytes / stream_s / 1e9:.3f} GB/s", f"ratio to raw {raw_s / stream_s:.2f} (goal >= 0.8)"],
    ], right={1})))
    print(f"trainer data-wait fraction at {args.step_ms:.0f} ms/sample: {wait:.1%} (goal <= 5%)")
    return 0
