"""scripts/gpu-check's table row and its checks of the data path around the model: the planes of
a one-rank world, the stream's receive buffers, and the capture connector's copy.

Only torch is needed (a bare GPU image has it): gpu-check imports this from the repository root.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from hpc.dist import rules
from hpc.dist.planes import Planes, init_planes
from hpc.dist.rendezvous import new_secret
from hpc.dist.rules import Message, NCCLRuleError
from hpc.dist.streams import RecvStream
from hpc.stream.protocol import BufferPool
from hpc.stream.sample import Capture
from hpc.stream.sender import SampleSender
from hpc.verifier.capture_copy import HostCopier, gather_blocks
from hpc.verifier.gpu_budget import CUDA_CONTEXT_BYTES, NCCL_COMM_BYTES, NCCL_PEER_BYTES

GB = 1e9


@dataclass
class Row:
    check: str
    status: str  # PASS | FAIL | n/a
    figures: str = ""
    data: dict = field(default_factory=dict)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev: torch.device, repeats: int = 5) -> float:
    """Median seconds of fn() after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- 3. the planes of a one-rank world ----------------------------------------------------------
def check_planes(dev: torch.device) -> Row:
    os.environ[rules.ENV] = "1"
    os.environ.pop(rules.LOG_ENV, None)  # the violation below is on purpose: keep it out of any test log
    backend = "nccl" if dev.type == "cuda" else "gloo"
    planes = init_planes(0, 1, [0], backend, dev, "127.0.0.1", _free_port(), new_secret(), timeout_s=120)
    # NCCL forms its communicators below after the store stopped listening (hpc.dist.rendezvous):
    # a new connection they needed would fail here, not on the first multi-node run.
    notes, ok = [], True
    try:
        flag = torch.tensor([3.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=planes.train_control)
        ok &= flag.item() == 3.0
        notes.append("control all_reduce (cpu, gloo) ok")
        grads = planes.place(torch.ones(1024, device=dev))
        with rules.message(Message.SAMPLE):
            dist.all_reduce(grads, group=planes.train_data)
        ok &= bool((grads == 1).all())
        notes.append(f"data all_reduce ({dev.type}, {backend}) ok")
        a = planes.place(torch.arange(4096, device=dev, dtype=torch.float32))
        b = planes.empty(4096, dtype=torch.float32).zero_()
        try:  # the data plane's device path: a sample-sized send to ourselves, batched
            ops = [c10d.P2POp(c10d.isend, a, 0, group=planes.data), c10d.P2POp(c10d.irecv, b, 0, group=planes.data)]
            with rules.message(Message.SAMPLE), RecvStream(dev) as side:
                for w in c10d.batch_isend_irecv(ops):
                    w.wait()
                side.synchronize()
            sync(dev)
            ok &= bool(torch.equal(a, b))
            notes.append("data self-send ok")
        except NCCLRuleError as err:  # our own code broke a rule: a FAIL on every device, or CPU hides it
            ok = False
            notes.append(f"data self-send REFUSED by the checker ({str(err)[:90]})")
        except (RuntimeError, ValueError) as err:
            if dev.type == "cuda":  # NCCL sends to itself: the streamer's path, so a failure fails
                ok = False
                notes.append(f"data self-send FAILED ({str(err).splitlines()[0][:80]})")
            else:
                notes.append("data self-send n/a (gloo cannot send to itself)")
        try:  # tagged as a sample, so only the device rule can fire; on CPU it runs as if on CUDA
            with rules.message(Message.SAMPLE):
                dist.all_reduce(torch.ones(1), group=planes.train_data)
            ok = False
            notes.append("checker MISSED a cpu tensor on the data plane")
        except NCCLRuleError as err:
            device_rule = "tensor on a data-plane group" in str(err)
            ok &= device_rule
            notes.append("checker refuses cpu tensor on data plane" if device_rule
                         else f"checker refused it by ANOTHER rule: {str(err)[:80]}")
        if dev.type == "cuda":  # what the checker's rule stands for: NCCL itself refuses it
            try:
                rules._originals["all_reduce"](torch.ones(1), group=planes.train_data)  # type: ignore[operator]
                notes.append("NCCL ACCEPTED a cpu tensor (rule 3 is stricter than needed)")
            except (RuntimeError, ValueError) as err:
                notes.append(f"NCCL refuses it too: '{str(err).splitlines()[0][:50]}'")
    finally:
        dist.destroy_process_group()
    return Row("planes (1-rank world)", "PASS" if ok else "FAIL", "; ".join(notes))


# -- 4. the stream's receive buffers ------------------------------------------------------------
def check_stream_pool(dev: torch.device) -> Row:
    """A buffer the trainer released is received into on the receive thread's stream: that must
    wait for the trainer's copy out of it (pack) on the default stream. A slow kernel ahead of
    the pack makes a missing wait show as a corrupted pack."""
    pool = BufferPool(dev)
    n, rounds, bad = 1 << 22, 8, 0
    for r in range(rounds):
        flat = pool.take(n * 4)
        buf = flat.view(torch.float32)
        buf.fill_(float(r))
        packed = torch.empty(n, device=dev)
        if dev.type == "cuda":
            torch.cuda._sleep(50_000_000)  # the default stream is busy when the pack is queued
        packed.copy_(buf)
        cap = cast("Capture", object())  # the pool keys a capture by identity only
        pool.lend(cap, flat)
        pool.release(cap)

        def receive() -> None:  # the receive thread: its own stream, the next sample lands in flat
            side = torch.cuda.Stream(dev) if dev.type == "cuda" else None
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                pool.take(n * 4).view(torch.float32).fill_(-1.0)
                if side is not None:
                    side.synchronize()

        t = threading.Thread(target=receive)
        t.start()
        t.join()
        sync(dev)
        bad += int(not bool((packed == float(r)).all()))
    return Row("stream receive buffers", "PASS" if bad == 0 else "FAIL",
               f"{rounds} released buffers received into from another stream: {bad} packs overwritten",
               {"bad": bad})


# -- 5. the capture connector's copy ------------------------------------------------------------
def check_capture_copy(dev: torch.device, d: dict) -> Row:
    T, n_ids, H, bs = d["cache_tokens"], 4, d["hidden"], 16
    n_blocks = math.ceil(T / bs)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(n_blocks + 64, n_ids, bs, H, generator=g).to(dev, dtype)
    ids = torch.randperm(n_blocks + 64, generator=g)[:n_blocks].tolist()
    gathered = gather_blocks(cache, ids, T)
    probe = [0, bs + 3, T - 1]
    ok = all(torch.equal(gathered[t], cache[ids[t // bs], :, t % bs]) for t in probe)
    t_gather = timed(lambda: gather_blocks(cache, ids, T), dev)
    size = gathered.numel() * gathered.element_size()
    if dev.type != "cuda":
        return Row("capture gather + copy", "PASS" if ok else "FAIL",
                   f"cpu: gather [{T}, {n_ids}, {H}] {t_gather * 1e3:.2f} ms; no pinned copy on CPU")
    pinned, pageable = HostCopier(dev, pinned=True), HostCopier(dev, pinned=False)

    def run(copier: HostCopier) -> tuple[float, float]:
        x = gather_blocks(cache, ids, T)
        sync(dev)
        t0 = time.perf_counter()
        c = copier.copy(x)
        blocked = time.perf_counter() - t0  # what the engine step waits for
        host = c.result()
        done = time.perf_counter() - t0
        assert torch.equal(host[probe[1]], x[probe[1]].cpu())
        c.release()
        return blocked, done

    run(pinned)  # allocates the pooled pinned buffer
    p_block, p_done = (statistics.median(v) for v in zip(*[run(pinned) for _ in range(3)]))
    u_block, u_done = (statistics.median(v) for v in zip(*[run(pageable) for _ in range(3)]))
    return Row("capture gather + copy", "PASS" if ok else "FAIL",
               f"[{T}, {n_ids}, {H}] bf16 = {size / GB:.2f} GB: gather {t_gather * 1e3:.1f} ms; pinned async: "
               f"step blocked {p_block * 1e3:.2f} ms, on host after {p_done * 1e3:.0f} ms "
               f"({size / p_done / GB:.1f} GB/s); pageable: blocked {u_block * 1e3:.0f} ms "
               f"({size / u_done / GB:.1f} GB/s); step stall {u_block / max(p_block, 1e-6):.0f}x less",
               {"bytes": size, "gather_s": t_gather, "pinned_blocked_s": p_block, "pinned_done_s": p_done,
                "pageable_s": u_done})


# -- 6. checkpoint --------------------------------------------------------------------------------
def check_checkpoint(trainer, dev: torch.device, where: Path) -> Row:
    # weights + AdamW's two moments, fp32, plus a second copy while the new one is renamed in
    need = 2 * sum(p.numel() * 4 * (3 if p.requires_grad else 1) for p in trainer.model.parameters())
    free = shutil.disk_usage(where).free
    if free < need:
        return Row("checkpoint save + load", "FAIL",
                   f"{where} has {free / GB:.1f} GB free, the checkpoint needs ~{need / GB:.1f} GB; "
                   "pass --checkpoint-dir on a larger disk", {"free_bytes": free, "need_bytes": need})
    ref = trainer.model.fc.weight.detach().clone()
    sync(dev)
    t0 = time.perf_counter()
    path = trainer.checkpoint()
    t_save = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in path.iterdir())
    with torch.no_grad():
        trainer.model.fc.weight.add_(1.0)
    t0 = time.perf_counter()
    trainer.resume(path)
    sync(dev)
    t_load = time.perf_counter() - t0
    ok = torch.equal(trainer.model.fc.weight, ref) and trainer.state.step > 0
    return Row("checkpoint save + load", "PASS" if ok else "FAIL",
               f"{size / GB:.2f} GB (weights + AdamW): save {t_save:.1f} s ({size / t_save / GB:.2f} GB/s), "
               f"load {t_load:.1f} s; weights round-trip exactly: {ok}; in {where} ({free / GB:.0f} GB free)",
               {"bytes": size, "save_s": t_save, "load_s": t_load})


# -- 8. the streamer's footprint on a verifier GPU ------------------------------------------------
_FOOTPRINT = r"""
import json, os, sys, torch, torch.distributed as dist, pynvml
pynvml.nvmlInit()
dev = int(sys.argv[1]); h = pynvml.nvmlDeviceGetHandleByIndex(dev)
used = lambda: pynvml.nvmlDeviceGetMemoryInfo(h).used
base = used()
torch.cuda.set_device(dev)
a = torch.randn(1024, 1024, device="cuda"); (a @ a).sum().item(); del a; torch.cuda.empty_cache()
ctx = used() - base
store = dist.TCPStore("127.0.0.1", int(sys.argv[2]), 1, True)
dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", dev))
x, y = torch.ones(1, device="cuda"), torch.zeros(1, device="cuda")
for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, 0), dist.P2POp(dist.irecv, y, 0)]):
    w.wait()
torch.cuda.synchronize(); del x, y; torch.cuda.empty_cache()
comm = used() - base - ctx
dist.destroy_process_group()
print(json.dumps({"context": ctx, "comm": comm}))
"""


def check_streamer_footprint(dev: torch.device) -> Row:
    """A fresh process's CUDA context and a one-rank NCCL communicator with a p2p connection,
    read from NVML, against what `dspark plan` counts for the streamer beside vLLM."""
    proc = subprocess.run([sys.executable, "-c", _FOOTPRINT, str(dev.index or 0), str(_free_port())],
                          capture_output=True, text=True, timeout=180)
    if proc.returncode != 0:
        return Row("streamer footprint", "FAIL", f"probe failed: {(proc.stderr.strip().splitlines() or ['?'])[-1][:120]}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    comm_plan = NCCL_COMM_BYTES + NCCL_PEER_BYTES
    ok = got["context"] <= CUDA_CONTEXT_BYTES and got["comm"] <= comm_plan
    return Row("streamer footprint", "PASS" if ok else "FAIL",
               f"NVML: CUDA context {got['context'] / GB:.2f} GB (plan {CUDA_CONTEXT_BYTES / GB:.2f}), NCCL "
               f"communicator + one p2p peer {got['comm'] / GB:.2f} GB (plan {comm_plan / GB:.2f})", got)


# -- 8. the streamer's staging ----------------------------------------------------------------------
def check_stream_staging(dev: torch.device, d: dict) -> Row:
    """hpc.stream.sender stages a sample: cast into pinned host memory, copied to the device on a
    side stream (non_blocking), which the sends then wait on. The device copy must be the
    capture, byte for byte; figures against a blocking copy from pageable memory."""
    T, A, H, dtype = d["cache_tokens"], 3, d["hidden"], torch.bfloat16
    g = torch.Generator().manual_seed(2)
    cap = Capture.from_states(0, torch.randint(0, 1000, (T,), generator=g), torch.ones(T, dtype=torch.long),
                              torch.randn(T, A + 1, H, generator=g).to(dtype))
    staging_only = Planes(0, 1, [0], dev, None, None, None, None)  # type: ignore[arg-type]  # no group: no sends
    sender = SampleSender(staging_only, dtype)

    def stage() -> tuple[float, float, list[torch.Tensor]]:
        t0 = time.perf_counter()
        f = sender._stage(cap, T, A, H)
        host = time.perf_counter() - t0  # what the streamer's main thread spends
        if f.copied is not None:
            f.copied.synchronize()
        done = time.perf_counter() - t0
        if f.pinned is not None:
            sender.free_pinned.append(f.pinned)
        return host, done, f.keep

    stage()  # the pinned buffer is allocated once, then reused
    runs = [stage() for _ in range(3)]
    ids, states = runs[-1][2]
    ok = torch.equal(states.cpu(), cap.packed_states()) and torch.equal(ids[0].cpu(), cap.input_ids_T)
    size = cap.packed_states().numel() * 2
    if dev.type != "cuda":
        return Row("stream staging", "PASS" if ok else "FAIL",
                   f"cpu: gloo sends the capture where it lies ({size / GB:.3f} GB); exact: {ok}")
    host, done = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
    blocking = timed(lambda: cap.packed_states().to(dev), dev, repeats=3)
    return Row("stream staging", "PASS" if ok else "FAIL",
               f"[{T}, {A + 1}, {H}] bf16 = {size / GB:.2f} GB: pinned staging {host * 1e3:.0f} ms on the main "
               f"thread, on the GPU after {done * 1e3:.0f} ms ({size / done / GB:.1f} GB/s); blocking pageable "
               f".to(cuda) {blocking * 1e3:.0f} ms; exact: {ok}",
               {"bytes": size, "host_s": host, "done_s": done, "pageable_s": blocking})
