"""The verifier's login-node checks: what the vLLM at verifier.python serves, and what fits on a
verifier node's GPUs. With the model's checks below them, these are every stage's checks but
launch's; `resolve` here is what the stage commands below launch resolve a config with.
"""

from __future__ import annotations

from hpc.config import resolver
from hpc.config.checker import Checker
from hpc.config.schema import DSparkConfig
from hpc.config.shared_sweep import share_key, shared_groups
from hpc.config.validate import DTYPES, CheckContext, trainer_ranks, vllm_interpreter, vllm_users
from hpc.model import model_checks
from hpc.verifier.gpu_budget import GB, headroom_bytes, shares_gpu_with_vllm, streamer_items
from hpc.verifier.vllm_support import support_problems


def check_gpu_named(c: Checker, cfg: DSparkConfig, ctx: CheckContext) -> None:
    """cluster.gpu names a GPU whose compute capability we know, or is unset."""
    if cfg.cluster.gpu is not None:
        from hpc.verifier.vllm_adaptive import check_gpu  # ast, subprocess: loaded only when a GPU is named

        check_gpu(c, cfg)


def check_served(c: Checker, cfg: DSparkConfig, ctx: CheckContext) -> None:
    """Ask the vLLM at verifier.python what it serves (the probe, cached), and on cluster.gpu
    whether its attention backend takes adaptive verification. The config's own check says
    when there is no interpreter to ask."""
    v = cfg.verifier
    found = vllm_interpreter(cfg)
    if not (ctx.check_vllm and v.probe and v.backend.value == "vllm" and vllm_users(cfg) and found):
        return
    values = {"verifier.python": v.python, "verifier.backend": v.backend.value, "eval.adaptive": True}
    problems = support_problems(found, v.model, list(ctx.shape.architectures), cfg.draft.sample_from_anchor,
                                cfg.eval.adaptive)
    for key, msg in problems:
        c.fail(key, values.get(key, v.model), msg)
    if cfg.eval.adaptive and cfg.cluster.gpu and not problems:
        from hpc.verifier.vllm_adaptive import check_adaptive_backend  # ast: loaded only for eval.adaptive

        check_adaptive_backend(c, cfg, found, ctx.shape.text_config)


def check_streamer_fits(c: Checker, cfg: DSparkConfig, ctx: CheckContext) -> None:
    """The streamer fits in what vLLM leaves of a verifier node's last GPU (with a shared verifier,
    beside a connection to every trainer rank of every variant)."""
    if not shares_gpu_with_vllm(cfg) or not 0 < cfg.verifier.gpu_memory_utilization < 1:
        return
    if cfg.stream.dtype not in ("auto", *DTYPES):
        return  # stream.dtype's own line says so; its size is unknown
    k = shared_groups(cfg)
    need = sum(b for _, b, _ in streamer_items(cfg, trainer_ranks(cfg) * k))
    left = headroom_bytes(cfg)
    if need > left and k > 1:
        fit = next((g for g in range(k - 1, 0, -1)
                    if sum(b for _, b, _ in streamer_items(cfg, trainer_ranks(cfg) * g)) <= left), 0)
        c.fail(share_key(cfg), True,
               f"the streamer feeding {k} variants' trainers needs {need / GB:.1f} GB of the verifier's last GPU and "
               f"vLLM leaves {left / GB:.1f} GB (plan.gpu_memory_gb={cfg.plan.gpu_memory_gb:g}); at most {fit} "
               "variants fit: sweep fewer values, or lower verifier.gpu_memory_utilization")
    elif need > left:
        most = 1 - need / (cfg.plan.gpu_memory_gb * GB)
        c.fail("verifier.gpu_memory_utilization", cfg.verifier.gpu_memory_utilization,
               f"leaves {left / GB:.1f} GB of the verifier's last GPU (plan.gpu_memory_gb={cfg.plan.gpu_memory_gb:g}), "
               f"and the streamer beside vLLM there needs {need / GB:.1f} GB (CUDA context, NCCL, the largest "
               f"sample; dspark plan lists them); use at most {max(most, 0):.2f}, or lower data.max_seq_len")


CHECKS = (*model_checks.CHECKS, check_gpu_named, check_served, check_streamer_fits)
resolve = resolver(CHECKS)
