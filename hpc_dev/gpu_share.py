"""gpu-check's two rows for the verifier node's last GPU, which vLLM's last TP rank shares with
the streamer and, in the calibrate stage, the draft (issue 45, item 6):

- "calibrate (fresh process)": the calibrate stage's pass as the stage runs it, in a process of
  its own: the export loaded in the training dtype, the teacher's rows in fp32, one longest
  held-out row, the fit. What the GPU then holds for that process is read from NVML (the CUDA
  context and the caching allocator's reserve included, which `max_memory_allocated` leaves
  out) and set against what vLLM leaves free and the plan's headroom.
- "time-slicing": without MPS, kernels of two processes on one GPU take turns. A GEMM loop (the
  stand-in for vLLM's TP rank) is timed alone and while a second process does the streamer's
  work on the same GPU: staging Kimi-size samples (pinned host memory, a non_blocking copy on
  a side stream) and a device copy of each (the bytes an NCCL send reads: one GPU cannot hold
  two NCCL ranks). The slowdown is what `plan.timeslice_slowdown` takes.

On CPU (--small) both run the same code, their figures the host's: the path cannot rot.
Run as `python -m hpc_dev.gpu_share calibrate|streamer ...` for the child processes.
"""

from __future__ import annotations

import json
import math
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from hpc_dev.gpu_checks import GB, Row, sync

ROOT = Path(__file__).resolve().parents[1]


def _used(dev: int):
    """A function reading the GPU's used bytes as the driver counts them (every context included):
    NVML through pynvml where installed, else the driver's nvidia-smi."""
    try:
        import pynvml  # type: ignore[import-not-found]  # nvidia-ml-py
    except ImportError:
        def smi() -> int:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                  "-i", str(dev)], capture_output=True, text=True, check=True).stdout
            return int(out.split()[0]) * 2**20  # MiB
        return smi
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(dev)
    return lambda: int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)


# -- the calibrate pass in a fresh process ----------------------------------------------------------
def _calibrate_child(export: str, device: str, d: dict, seq: int, ns: list[int]) -> dict:
    dev = torch.device(device)
    used = _used(dev.index or 0) if dev.type == "cuda" else None
    base = used() if used else 0  # before this process holds a CUDA context
    # after the base reading: nothing of the stage may be on the GPU before it
    from hpc.calibration.fit import fit_calibration, held_out_slots
    from hpc.calibration.stage import decodable
    from hpc.model.export import load_draft
    from hpc.model.teacher import VerifierHead
    from hpc.train.trainer import pack
    from hpc_dev.gpu_trainer import sample

    amp = torch.bfloat16 if dev.type == "cuda" else None  # the stage: the training dtype, under autocast
    t0 = time.perf_counter()
    model = load_draft(export, device=device, dtype=amp or torch.float32).eval()
    head = VerifierHead(torch.randn(d["draft_vocab"], d["hidden"]) * 0.02,  # target_head's default: fp32
                        torch.ones(d["draft_vocab"], dtype=torch.bool)).to(dev)
    row = pack(sample(d, seq, dev, torch.float32, 11).mine)  # the verifier hands float32 captures
    with torch.no_grad(), torch.autocast(dev.type, dtype=amp or torch.bfloat16, enabled=amp is not None):
        slots = held_out_slots(model, [row], head, max_anchors=512, ns=decodable(model, ns))
    fit_calibration(slots)
    sync(dev)
    out = {"slots": slots.logit.numel(), "pass_s": time.perf_counter() - t0}
    if used:
        out.update(used=used() - base, allocated_peak=torch.cuda.max_memory_allocated(dev))
    else:
        out["rss_peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def export_for_calibrate(trainer, tmp: Path) -> Path:
    """The draft as the calibrate stage finds it: an export on disk (written while the trainer is
    alive; the probe runs once it is gone, so the GPU holds only the probe)."""
    from hpc.model.export import export_draft  # safetensors: as gpu-check's other rows, on this path only

    return export_draft(trainer.model, tmp / "calibrate-export")


def check_calibrate_fresh(export: Path, cfg, d: dict, dev: torch.device) -> Row:
    """The calibrate stage's memory on the verifier's last GPU, read as NVML sees the process."""
    from hpc.verifier.gpu_budget import headroom_bytes  # the plan's figure, for this row only

    seq = max(t for t, _ in d["steps"])
    arg = json.dumps({"export": str(export), "device": str(dev), "d": d, "seq": seq,
                      "ns": list(cfg.eval.num_speculative_tokens)})
    proc = subprocess.run([sys.executable, "-m", "hpc_dev.gpu_share", "calibrate", arg], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    if proc.returncode != 0:
        return Row("calibrate (fresh process)", "FAIL",
                   f"probe failed: {(proc.stderr.strip().splitlines() or ['?'])[-1][:140]}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    ok = got["slots"] > 0
    if dev.type != "cuda":
        return Row("calibrate (fresh process)", "PASS" if ok else "FAIL",
                   f"cpu: {got['slots']} slots from one {seq}-token row in {got['pass_s']:.2f} s, peak RSS "
                   f"{got['rss_peak'] / GB:.2f} GB (NVML reads GPUs only)", got)
    total = torch.cuda.get_device_properties(dev).total_memory
    free = (1 - cfg.verifier.gpu_memory_utilization) * total
    plan = headroom_bytes(cfg)
    ok = ok and got["used"] <= min(free, plan)
    return Row("calibrate (fresh process)", "PASS" if ok else "FAIL",
               f"NVML {got['used'] / GB:.1f} GB for the process (context + allocator reserve; peak allocated "
               f"{got['allocated_peak'] / GB:.1f} GB) vs {free / GB:.1f} GB vLLM leaves at gpu_memory_utilization "
               f"{cfg.verifier.gpu_memory_utilization} and the plan's headroom {plan / GB:.1f} GB; "
               f"{got['slots']} slots from one {seq}-token row in {got['pass_s']:.1f} s",
               {**got, "free": free, "plan_headroom": plan})


# -- time-slicing: a GEMM loop beside the streamer's work ------------------------------------------
def _streamer_child(device: str, d: dict, seconds: float) -> None:
    """The streamer's work on the GPU, over and over, until `seconds` pass: stage a sample, copy it
    on the device. Prints one line when the first sample is through (the timing may start)."""
    # the child's own: the stream's sender, in the process that plays the streamer
    from hpc.dist.planes import Planes
    from hpc.stream.sample import Capture
    from hpc.stream.sender import SampleSender

    dev = torch.device(device)
    T, A, H = d["cache_tokens"], 3, d["hidden"]
    cap = Capture.from_states(0, torch.zeros(T, dtype=torch.long), torch.ones(T, dtype=torch.long),
                              torch.randn(T, A + 1, H).to(torch.bfloat16))
    sender = SampleSender(Planes(0, 1, [0], dev, None, None, None, None), torch.bfloat16)  # type: ignore[arg-type]
    end, first, n = time.monotonic() + seconds, True, 0
    while time.monotonic() < end:
        f = sender._stage(cap, T, A, H)
        if f.copied is not None:
            f.copied.synchronize()
        states = f.keep[1]
        sent = states.clone()  # what an NCCL send reads from the device, once per trainer
        sync(dev)
        if f.pinned is not None:
            sender.free_pinned.append(f.pinned)
        del sent
        n += 1
        if first:
            print("ready", flush=True)
            first = False
    print(json.dumps({"samples": n}), flush=True)


def _gemm_windows(dev: torch.device, small: bool, windows: int) -> list[float]:
    n = 256 if small else 8192
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    reps = 20 if small else 50
    out = []
    for _ in range(windows):
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        sync(dev)
        out.append(time.perf_counter() - t0)
    return out


def check_timeslice(dev: torch.device, d: dict, small: bool) -> Row:
    """GEMM time alone, beside the streamer's staging and copies, and alone again; medians."""
    _gemm_windows(dev, small, 2)  # warm-up: cuBLAS's choice, the clocks
    alone = _gemm_windows(dev, small, 7)
    arg = json.dumps({"device": str(dev), "d": d, "seconds": 60.0})
    child = subprocess.Popen([sys.executable, "-m", "hpc_dev.gpu_share", "streamer", arg], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        ready = child.stdout.readline().strip() if child.stdout else ""
        if ready != "ready":
            child.kill()
            err = (child.communicate(timeout=30)[1] or "?").strip().splitlines() or ["?"]
            return Row("time-slicing", "FAIL", f"streamer process failed: {err[-1][:140]}")
        beside = _gemm_windows(dev, small, 7)
    finally:
        child.kill()
        child.wait(timeout=30)
    after = _gemm_windows(dev, small, 7)
    base, slow = statistics.median(alone + after), statistics.median(beside)
    # plan.timeslice_slowdown is the share of the TP rank's throughput lost, in [0, 1)
    lost = max(0.0, 1 - base / slow) if slow > 0 else math.nan
    ok = math.isfinite(lost)
    return Row("time-slicing", "PASS" if ok else "FAIL",
               f"GEMM loop {base * 1e3:.1f} ms alone, {slow * 1e3:.1f} ms beside the streamer's staging and device "
               f"copies ({d['cache_tokens']}-token samples): {lost:.1%} of its throughput lost; "
               f"set plan.timeslice_slowdown={lost:.3f}" + (" (cpu: the cores', not a GPU's)" if dev.type == "cpu" else ""),
               {"alone_s": base, "beside_s": slow, "slowdown": lost})


if __name__ == "__main__":
    what, spec = sys.argv[1], json.loads(sys.argv[2])
    if what == "calibrate":
        print(json.dumps(_calibrate_child(spec["export"], spec["device"], spec["d"], spec["seq"], spec["ns"])))
    elif what == "streamer":
        _streamer_child(spec["device"], spec["d"], spec["seconds"])
    else:
        sys.exit(f"gpu_share: unknown child {what!r}")
