"""What a vLLM install can do for us, asked from inside its own interpreter (stdlib + vllm only).

    <verifier.python> -I hpc/verifier/vllm_probe.py ARCH [ARCH ...]   ->  one JSON line

- `dspark`: the speculative method exists (`vllm.config.speculative.SpeculativeMethod`);
- `sample_from_anchor`: the speculators loader for dspark passes the draft's flag through.
  Releases before 0.27 hard-code the bonus-anchor layout and serve a sample_from_anchor=true
  draft one slot shifted, at about half the acceptance, with no error;
- `aux_hidden_states[ARCH]`: the target's model class implements SupportsEagle3, which
  `extract_hidden_states` (capture) and `dspark` (serving) both require of the target;
- `hidden_state_api`: every vLLM name our capture connector (hpc/verifier/capture_connector.py)
  imports: the v1 KV-connector base, the layer lookup, the hidden-state cache spec and the
  cache-only attention layer `extract_hidden_states` writes through;
- `adaptive_verification`: SpeculativeConfig has `enable_adaptive_verification` (eval.adaptive).
Run by file path: the rest of hpc is not importable from vLLM's venv.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import sys
import typing

import vllm


def _dspark_method() -> bool:
    from vllm.config.speculative import SpeculativeMethod  # each probe's import is its question: a miss is False

    def flat(t):
        for a in typing.get_args(t):
            yield from (flat(a) if typing.get_args(a) else [a])
    return "dspark" in set(flat(SpeculativeMethod))


def _honours_sample_from_anchor() -> bool:
    # each probe's import is its question: a vLLM without the module answers False
    from vllm.transformers_utils.configs.speculators.algos import SUPPORTED_SPECULATORS_TYPES

    update = SUPPORTED_SPECULATORS_TYPES.get("dspark")
    if update is None:
        return False
    out: dict = {}
    update({"aux_hidden_state_layer_ids": [2, 4], "mask_token_id": 3, "sample_from_anchor": True}, out)
    return out.get("sample_from_anchor") is True and not out.get("dspark_bonus_anchor", False)


def _hidden_state_api() -> bool:
    wanted = {"vllm.config": ["VllmConfig", "get_layers_from_vllm_config"],
              "vllm.distributed.kv_transfer.kv_connector.v1.base": ["KVConnectorBase_V1", "KVConnectorMetadata",
                                                                   "KVConnectorRole", "SupportsHMA"],
              "vllm.v1.kv_cache_interface": ["HiddenStateCacheSpec"],
              "vllm.model_executor.models.extract_hidden_states": ["CacheOnlyAttentionLayer"]}
    for module, names in wanted.items():
        mod = importlib.import_module(module)
        missing = [n for n in names if not hasattr(mod, n)]
        if missing:
            raise ImportError(f"{module} has no {', '.join(missing)}")
    return True


def _adaptive_verification() -> bool:
    from vllm.config.speculative import SpeculativeConfig  # each probe's import is its question: a miss is False

    return "enable_adaptive_verification" in {f.name for f in dataclasses.fields(SpeculativeConfig)}


def _aux_hidden_states(arch: str) -> bool | None:
    """True/False for a registered architecture; None when this vLLM does not know it."""
    # each probe's import is its question: a vLLM without the module answers None (in probe)
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_eagle3

    cls = ModelRegistry._try_load_model_cls(arch)
    return None if cls is None else bool(supports_eagle3(cls))


def probe(archs: list[str]) -> dict:
    out: dict = {"version": vllm.__version__, "errors": {}}
    for key, fn in (("dspark", _dspark_method), ("sample_from_anchor", _honours_sample_from_anchor),
                    ("hidden_state_api", _hidden_state_api), ("adaptive_verification", _adaptive_verification)):
        try:
            out[key] = fn()
        except Exception as err:  # noqa: BLE001 - an API this version lacks means "no"
            out[key] = False
            out["errors"][key] = f"{type(err).__name__}: {err}"
    out["aux_hidden_states"] = {}
    for arch in archs:
        try:
            out["aux_hidden_states"][arch] = _aux_hidden_states(arch)
        except Exception as err:  # noqa: BLE001
            out["aux_hidden_states"][arch] = None
            out["errors"][arch] = f"{type(err).__name__}: {err}"
    return out


if __name__ == "__main__":
    print(json.dumps(probe(sys.argv[1:])))
