"""Load our DSpark export through vLLM's own `Qwen3DSparkForCausalLM.load_weights`, on CPU.

Runs with the vLLM venv's python (never imports `hpc`).

vLLM 0.32 on CPU refuses a DSpark *engine*: VllmConfig validation says the V1 model runner does
not support dspark, and the V2 runner needs Triton. Neither matters for weight loading, so the
config is built in two legal halves: a plain VllmConfig for the target, then vLLM's own
SpeculativeConfig for our export (its speculators-config parsing, `update_dspark`, runs
unchanged), attached afterwards. That skips only VllmConfig's engine-level spec adjustments
(scheduler budgets); the model class reads just the draft hf_config and the target's config.
It is then constructed and loaded as vLLM's loader would, under `set_current_vllm_config`
with a one-rank gloo group.

Every parameter's `weight_loader` is wrapped to record each call: a tensor that vLLM's
mappers drop silently (e.g. AutoWeightsLoader ignores unexpected `.bias` names) never reaches
a loader, so "calls == tensors in the file" proves every tensor was consumed. Parameters are
filled with NaN first, so any left unloaded still read NaN afterwards.

    python vllm_dspark_loader.py TARGET_DIR EXPORT_DIR LOADED.safetensors
    -> one JSON object on the last stdout line; the loaded parameters, under vLLM's names, in
       LOADED.safetensors for an exact comparison on the test side
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

# Fields of our config.json that vLLM must carry onto the draft hf_config it builds.
HF_FIELDS = ["sample_from_anchor", "markov_rank", "draft_vocab_size", "mask_token_id", "block_size",
             "target_hidden_size", "enable_confidence_head", "confidence_head_with_markov",
             "eagle_aux_hidden_state_layer_ids", "vocab_size", "hidden_size", "architectures"]


def engine_args(target: str, spec: dict | None):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=target, dtype="float32", enforce_eager=True, gpu_memory_utilization=0.5,
                      max_model_len=1024, speculative_config=spec)


def build_config(target: str, draft: str) -> tuple[object, str]:
    """(VllmConfig with our dspark SpeculativeConfig, the error the one-step way raises)."""
    spec = {"method": "dspark", "model": draft, "num_speculative_tokens": 8}
    try:
        engine_args(target, dict(spec)).create_engine_config()
        refusal = ""
    except Exception as err:  # pydantic ValidationError wrapping vLLM's ValueError
        refusal = f"{type(err).__name__}: {err}"
    cfg = engine_args(target, None).create_engine_config()
    cfg.speculative_config = engine_args(target, dict(spec)).create_speculative_config(
        cfg.model_config, cfg.parallel_config)
    return cfg, refusal


def init_one_rank(cfg) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(cfg):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        ensure_model_parallel_initialized(1, 1)


def construct(cfg):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

    # Attention layers register by name in the config; a second model would collide.
    cfg.compilation_config.static_forward_context.clear()
    with set_current_vllm_config(cfg), torch.device("cpu"):
        return Qwen3DSparkForCausalLM(vllm_config=cfg, prefix="")


def instrument(model) -> list[list]:
    """NaN-fill every parameter and record every weight_loader call as [param, shard, shape]."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    calls: list[list] = []
    for name, param in model.named_parameters():
        with torch.no_grad():
            param.fill_(float("nan") if param.dtype.is_floating_point else -(2**40))
        inner = getattr(param, "weight_loader", default_weight_loader)

        def recording(p, w, *args, _name=name, _inner=inner, **kw):
            calls.append([_name, None if not args else str(args[0]), list(w.shape)])
            return _inner(p, w, *args, **kw)
        param.weight_loader = recording
    return calls


def load(cfg, tensors: dict[str, torch.Tensor]) -> dict:
    """Construct, load `tensors`, and report what vLLM built and consumed."""
    from vllm.config import set_current_vllm_config

    model = construct(cfg)
    calls = instrument(model)
    with set_current_vllm_config(cfg):
        model.load_weights(iter(tensors.items()))
    params = dict(model.named_parameters())
    unloaded = [n for n, p in params.items()
                if (torch.isnan(p).any() if p.dtype.is_floating_point else (p == -(2**40)).any())]
    return {
        "params": {n: list(p.shape) for n, p in params.items()},
        "calls": calls,
        "unloaded": unloaded,
        "has_confidence_head": model.model.confidence_head is not None,
        "has_d2t": model.draft_id_to_target_id is not None,
        "_tensors": {n: p.detach().contiguous() for n, p in params.items() if n not in unloaded},
    }


def refusal_of(cfg, tensors: dict[str, torch.Tensor]) -> str:
    """The error vLLM's loader raises for this tensor set ('' if it loads)."""
    try:
        load(cfg, tensors)
        return ""
    except Exception as err:
        return f"{type(err).__name__}: {err}"


def main() -> None:
    target, draft, loaded_out = sys.argv[1], sys.argv[2], sys.argv[3]
    tensors = load_file(os.path.join(draft, "model.safetensors"))
    out: dict = {"construct_error": None}
    try:
        cfg, out["engine_config_refusal"] = build_config(target, draft)
        hf = cfg.speculative_config.draft_model_config.hf_config
        out["hf_config"] = {k: getattr(hf, k, None) for k in HF_FIELDS}
        init_one_rank(cfg)
        out["load"] = load(cfg, tensors)
        save_file(out["load"].pop("_tensors"), loaded_out)
    except Exception:
        out["construct_error"] = traceback.format_exc(limit=4)
        print(json.dumps(out))
        return
    # vLLM's required-tensor checks must be live, not vacuous, on this very export.
    without = lambda *names: {k: v for k, v in tensors.items() if k not in names}  # noqa: E731
    out["refusals"] = {
        "no_lm_head": refusal_of(cfg, without("lm_head.weight")),
        "no_d2t": refusal_of(cfg, without("d2t")),
        "stray_tensor": refusal_of(cfg, {**tensors, "markov_head.gate_proj.weight": torch.zeros(4, 4)}),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
