"""Will vLLM run adaptive verification for this target on this GPU? Asked of vLLM's own source.

`eval.adaptive` starts vLLM with `enable_adaptive_verification`, which vLLM refuses at start-up
(`v1/worker/gpu/spec_decode/adaptive_verification.py`) unless the target's attention backend
replays variable-length decode batches of up to n + 1 tokens in full CUDA graphs: its metadata
builder reports `AttentionCGSupport.ALWAYS`, or gives a bound of at least n + 1
(`get_varlen_cudagraph_max_query_len`, None by default in `v1/attention/backend.py`). On Kimi
(MLA) on an H200 the first backend vLLM picks is FlashAttn-MLA, UNIFORM_BATCH without a bound:
learnt there only after a full 1T load, half an hour of eight GPUs.

The login node has no GPU, and importing vLLM takes seconds, so the answer is read from vLLM's
source files with `ast`, as vLLM itself would decide it: the backend priority list for the GPU's
compute capability (`platforms/cuda.py`, `_get_backend_priorities`, run on stand-ins), the
first backend whose `supports_compute_capability` holds (and, since adaptive verification is
on, `supports_device_cpu_query_lens_mismatch`), then its builder's support and bound. What the
source does not settle statically (a method that computes its answer) is said, never guessed.
"""

from __future__ import annotations
import __future__

import ast
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# GPU names a cluster user types -> CUDA compute capability. A capability may be given as is.
GPUS = {"a100": (8, 0), "a800": (8, 0), "l40s": (8, 9), "h100": (9, 0), "h800": (9, 0), "h20": (9, 0),
        "h200": (9, 0), "gh200": (9, 0), "b200": (10, 0), "gb200": (10, 0), "b300": (10, 3), "gb300": (10, 3),
        "rtx-pro-6000": (12, 0)}
ALWAYS = "ALWAYS"


class Unknown(Exception):
    """The source decides this at run time; the static reading cannot say."""


def compute_capability(gpu: str) -> tuple[int, int]:
    """`h200`, `sm90`, `9.0` or `90` -> (9, 0); ValueError naming what is accepted."""
    g = str(gpu).strip().lower()
    if g in GPUS:
        return GPUS[g]
    digits = g.removeprefix("sm").removeprefix("_")
    major, dot, minor = digits.partition(".")
    if dot and major.isdigit() and minor.isdigit() and len(minor) == 1:
        return int(major), int(minor)
    if not dot and digits.isdigit() and len(digits) in (2, 3):
        return int(digits[:-1]), int(digits[-1])
    raise ValueError(f"not a GPU this check knows: give one of {', '.join(sorted(GPUS))}, or a compute "
                     "capability such as 9.0 or sm90")


def vllm_source(python: str) -> Path | None:
    """The directory of the vLLM package that interpreter would import, found without importing it."""
    code = ("import importlib.util, json\ns = importlib.util.find_spec('vllm')\n"
            "print(json.dumps(list(s.submodule_search_locations or []) if s else []))")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME", "PYTHONPATH")}
    try:
        out = subprocess.run([python, "-I", "-c", code], capture_output=True, text=True, timeout=60, env=env)
        found = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else []
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    return Path(found[0]) if found else None


@dataclass
class Verdict:
    backend: str  # the backend vLLM would pick, as its enum names it
    support: str  # its builder's AttentionCGSupport member
    bound: int | None  # the variable-length bound it gives, when it gives one
    refused: bool

    def line(self, n: int) -> str:
        bound = "no variable-length bound" if self.bound is None else f"variable-length bound {self.bound}"
        return (f"{self.backend} (cudagraph support {self.support}, {bound}) cannot replay the verification "
                f"batches of 1 to {n + 1} tokens per request that adaptive verification at n={n} needs")


def source_version(root: Path) -> str:
    """The version vLLM's generated `_version.py` records, read, not imported."""
    try:
        for node in ast.parse((root / "_version.py").read_text(encoding="utf-8")).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and any(
                    isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets):
                return str(node.value.value)
    except (OSError, SyntaxError):
        pass
    return "(version unknown)"


class _Source:
    """Classes and functions of vLLM's files, parsed on demand, resolved through `from` imports."""

    def __init__(self, root: Path):
        self.root, self._trees = root, dict[str, ast.Module]()

    def module(self, dotted: str) -> ast.Module:
        if dotted not in self._trees:
            rel = Path(*dotted.split(".")[1:])  # drop the leading `vllm`
            path = next((p for p in (self.root / f"{rel}.py", self.root / rel / "__init__.py") if p.is_file()), None)
            if path is None:
                raise Unknown(f"{dotted} is not in {self.root}")
            self._trees[dotted] = ast.parse(path.read_text(encoding="utf-8"), str(path))
        return self._trees[dotted]

    def cls(self, module: str, name: str) -> tuple[str, ast.ClassDef]:
        tree = self.module(module)
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return module, node
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module and any((a.asname or a.name) == name for a in node.names):
                real = next(a.name for a in node.names if (a.asname or a.name) == name)
                return self.cls(node.module, real)
        raise Unknown(f"class {name} not found from {module}")

    def lookup(self, module: str, node: ast.ClassDef, member: str) -> tuple[str, ast.AST] | None:
        """`member` as the class or its first base defining it has it (depth-first, as single inheritance)."""
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == member:
                return module, item
            targets = (item.targets if isinstance(item, ast.Assign)
                       else [item.target] if isinstance(item, ast.AnnAssign) else [])
            if any(isinstance(t, ast.Name) and t.id == member for t in targets) and getattr(item, "value", None):
                return module, item
        for base in node.bases:
            base = base.value if isinstance(base, ast.Subscript) else base  # Builder[Metadata]
            if isinstance(base, ast.Name) and base.id not in ("ABC", "Generic", "object"):
                try:
                    found = self.lookup(*self.cls(module, base.id), member)
                except Unknown:
                    continue
                if found is not None:
                    return found
        return None


class _Names:
    """Stands in for vLLM's enums: any member is its own name."""

    def __getattr__(self, name: str) -> str:
        return name


class _Capability:
    def __init__(self, major: int, minor: int):
        self.major, self.minor = major, minor

    def to_int(self) -> int:
        return self.major * 10 + self.minor

    def as_version_str(self) -> str:
        return f"{self.major}.{self.minor}"


def _run(fn: ast.FunctionDef, where: str, args: dict, extra: dict | None = None):
    """Call one function of vLLM's source on stand-ins; Unknown if it needs anything else."""
    fn = ast.FunctionDef(**{**fn.__dict__, "decorator_list": [], "body": [
        s for s in fn.body if not isinstance(s, (ast.Import, ast.ImportFrom))]})  # lazy imports: stand-ins given
    code = compile(ast.fix_missing_locations(ast.Module(body=[fn], type_ignores=[])), where, "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    space: dict = {"__builtins__": {"len": len, "any": any, "all": all, "list": list, "tuple": tuple, "True": True,
                                    "False": False, "None": None, "isinstance": isinstance, "int": int},
                   "AttentionBackendEnum": _Names(),
                   "is_quantized_kv_cache": lambda dtype: bool(dtype) and "fp8" in str(dtype),
                   **(extra or {})}
    exec(code, space)  # noqa: S102 - the user's own vLLM source, run on stand-ins, to read its decision
    try:
        return space[fn.name](**args)
    except Exception as err:  # noqa: BLE001 - anything it needs beyond the stand-ins
        raise Unknown(f"{fn.name} in {where} decides at run time ({type(err).__name__})") from None


def _constant(node: ast.AST) -> str | None:
    """`AttentionCGSupport.X` -> "X"; a parenthesised one too."""
    value = getattr(node, "value", None)
    return value.attr if isinstance(value, ast.Attribute) else None


def pick(root: Path, cc: tuple[int, int], mla: bool, num_heads: int | None = None, head_size: int | None = None,
         forced: str | None = None) -> tuple[str, str, str]:
    """(enum name, module, class) of the target attention backend vLLM would run on that GPU."""
    src = _Source(root)
    registry = {}
    for node in src.cls("vllm.v1.attention.backends.registry", "AttentionBackendEnum")[1].body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            registry[node.targets[0].id] = node.value.value  # type: ignore[attr-defined]
    if forced:
        names = [forced.upper()]
    else:
        fn = next(n for n in src.module("vllm.platforms.cuda").body
                  if isinstance(n, ast.FunctionDef) and n.name == "_get_backend_priorities")
        given = {"use_mla": mla, "device_capability": _Capability(*cc), "num_heads": num_heads,
                 "kv_cache_dtype": None, "head_size": head_size}
        names = _run(fn, "platforms/cuda.py", {a.arg: given[a.arg] for a in fn.args.args if a.arg in given})
    for name in names:
        if name not in registry:
            raise Unknown(f"{name} is not in vLLM's AttentionBackendEnum")
        module, _, cls_name = registry[name].rpartition(".")
        where, node = src.cls(module, cls_name)
        found = src.lookup(where, node, "supports_compute_capability")
        ok = True
        if found is not None:
            method = found[1]
            if not isinstance(method, ast.FunctionDef):
                raise Unknown(f"{cls_name}.supports_compute_capability is not a plain method")
            ok = _run(method, found[0], {"cls": None, "capability": _Capability(*cc)})
        mismatch = src.lookup(where, node, "supports_device_cpu_query_lens_mismatch")
        if mismatch is not None and isinstance(mismatch[1], ast.FunctionDef):
            ok = ok and _run(mismatch[1], mismatch[0], {"cls": _NotSsm()})
        if ok:
            return name, module, cls_name
        if forced:
            raise Unknown(f"the forced backend {name} does not run on compute capability {cc[0]}.{cc[1]}")
    raise Unknown(f"no backend in vLLM's list for compute capability {cc[0]}.{cc[1]} supports it")


class _NotSsm:
    @staticmethod
    def is_ssm() -> bool:  # the target's attention layers; SSM layers are not what we check
        return False


def adaptive_verdict(root: Path, cc: tuple[int, int], n: int, mla: bool, num_heads: int | None = None,
                     head_size: int | None = None, forced: str | None = None) -> Verdict:
    """What vLLM decides at start-up for adaptive verification at n. Raises Unknown when its
    source computes the answer at run time."""
    name, module, cls_name = pick(root, cc, mla, num_heads, head_size, forced)
    src = _Source(root)
    where, node = src.cls(module, cls_name)
    builder_fn = src.lookup(where, node, "get_builder_cls")
    if builder_fn is None or not isinstance(builder_fn[1], ast.FunctionDef):
        raise Unknown(f"{cls_name} names no metadata builder")
    ret = next((s.value for s in builder_fn[1].body if isinstance(s, ast.Return)), None)
    if not isinstance(ret, ast.Name):
        raise Unknown(f"{cls_name}.get_builder_cls decides at run time")
    bwhere, builder = src.cls(builder_fn[0], ret.id)
    dynamic = src.lookup(bwhere, builder, "get_cudagraph_support")
    if dynamic is not None and dynamic[0] != "vllm.v1.attention.backend":
        raise Unknown(f"{ret.id}.get_cudagraph_support decides at run time")
    found = src.lookup(bwhere, builder, "_cudagraph_support")
    support = _constant(found[1]) if found else None
    if support is None:
        raise Unknown(f"{ret.id} sets no AttentionCGSupport")
    if support == ALWAYS:
        return Verdict(name, support, None, False)
    bound_fn = src.lookup(bwhere, builder, "get_varlen_cudagraph_max_query_len")
    if support != "NEVER" and bound_fn is not None and bound_fn[0] != "vllm.v1.attention.backend":
        raise Unknown(f"{ret.id}.get_varlen_cudagraph_max_query_len decides at run time")
    return Verdict(name, support, None, True)


def forced_backend(extra_args: list[str]) -> str | None:
    """The backend `--attention-backend X` (or `=X`) in verifier.extra_args forces, if any."""
    for i, arg in enumerate(extra_args):
        if arg.startswith("--attention-backend="):
            return arg.partition("=")[2]
        if arg == "--attention-backend" and i + 1 < len(extra_args):
            return extra_args[i + 1]
    return None


def attention_shape(text_config: dict) -> tuple[bool, int | None, int | None]:
    """(MLA?, heads, the head size vLLM's selector sees) from the target's config.json."""
    heads = text_config.get("num_attention_heads")
    if text_config.get("kv_lora_rank"):  # DeepSeek-V2/V3 and Kimi-K2: the latent cache plus the rope part
        return True, heads, int(text_config["kv_lora_rank"]) + int(text_config.get("qk_rope_head_dim") or 0)
    size = text_config.get("head_dim") or (text_config.get("hidden_size", 0) // heads if heads else None)
    return False, heads, size


def adaptive_problem(python: str, gpu: str, n: int, text_config: dict, extra_args: list[str],
                     root: Path | None = None) -> tuple[str, str] | None:
    """("error" | "warning", line) when vLLM would refuse adaptive verification, or when its
    source cannot say; None when it would start. `root`: vLLM's package directory (tests)."""
    root = root or vllm_source(python)
    where = f"the vLLM in {python}"
    if root is None:
        return "warning", f"eval.adaptive: cannot find {where}'s source to ask whether it accepts adaptive verification"
    if not text_config:
        return "warning", ("eval.adaptive: the target's config.json is not on this machine, so whether vLLM accepts "
                           "adaptive verification on cluster.gpu is unchecked; put it in the HF cache "
                           "(`hf download MODEL config.json`) and validate again")
    mla, heads, size = attention_shape(text_config)
    cc = compute_capability(gpu)
    try:
        verdict = adaptive_verdict(root, cc, n, mla, heads, size, forced_backend(extra_args))
    except (Unknown, OSError, SyntaxError) as err:
        return "warning", f"eval.adaptive: {where} decides at start-up whether it accepts adaptive verification ({err})"
    if not verdict.refused:
        return None
    return "error", (f"vLLM {source_version(root)} ({python}) refuses adaptive verification "
                     f"on {gpu} (compute capability {cc[0]}.{cc[1]}): its {'MLA ' if mla else ''}attention backend "
                     f"{verdict.line(n)}; set eval.adaptive=false, or evaluate on a GPU whose backend replays them "
                     "(FlashInfer-MLA on SM100: b200)")


def check_gpu(c, cfg) -> None:
    """cluster.gpu names a GPU this module can turn into a compute capability, or is unset."""
    if cfg.cluster.gpu is not None:
        try:
            compute_capability(cfg.cluster.gpu)
        except ValueError as err:
            c.fail("cluster.gpu", cfg.cluster.gpu, str(err))


def check_adaptive_backend(c, cfg, python: str, text_config: dict) -> None:
    """validate's line for eval.adaptive on cluster.gpu: an error when that vLLM would refuse it."""
    try:
        compute_capability(cfg.cluster.gpu)
    except ValueError:
        return  # check_gpu says so
    found = adaptive_problem(python, cfg.cluster.gpu, max(cfg.eval.num_speculative_tokens), text_config,
                             list(cfg.verifier.extra_args))
    if found is None:
        return
    kind, line = found
    if kind == "error":
        c.fail("eval.adaptive", True, line)
    else:
        print(f"warning: {line}", file=sys.stderr)
