"""Where a number was measured: a baseline is only reused on the same hardware."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess


def hardware_id() -> str:
    """e.g. '8x NVIDIA H200' or 'cpu: AMD EPYC x2'."""
    if shutil.which("nvidia-smi"):
        try:
            names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                   text=True, timeout=30).stdout.split("\n")
            names = [n.strip() for n in names if n.strip()]
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            if visible:
                names = names[:len(visible.split(","))]
            if names:
                return f"{len(names)}x {names[0]}"
        except (OSError, subprocess.TimeoutExpired):
            pass
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"cpu: {model} x{len(os.sched_getaffinity(0))}"
