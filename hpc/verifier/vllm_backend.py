"""The vLLM verifier backend: a vLLM server prefills known token ids and we read its hidden states.

Server side (flags built from VerifierConfig in `server_args`):
- speculative method `extract_hidden_states` with `eagle_aux_hidden_state_layer_ids` = our aux
  ids plus `num_hidden_layers` (the last layer's output, which the last hidden state needs),
  sorted and without repeats, since vLLM collects them in layer order;
- our KV connector (capture_connector.py, loaded via `kv_connector_module_path`) writes one
  safetensors file per request into a private 0700 directory of this server under
  `<capture_dir>` (node-local RAM, /dev/shm, which every user of the node shares).

Client side, `VLLMVerifier.capture(sample_id, ids, mask)`: POST /v1/completions with the ids as
the prompt and max_tokens=1 (only prompt tokens are saved), wait for the file named in
`kv_transfer_params`, read it, delete it, and build aux [T, n_aux, H] and the last hidden state.
Problems with one sample's file raise CaptureError, so the streamer skips that sample only; a
path outside our directory is refused (we delete what we read). Requests carry the key.
The client must run on the server's node (the streamer does): the path is node-local.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
import torch
from safetensors import SafetensorError, safe_open

from hpc.config.schema import FinalHidden, VerifierConfig
from hpc.errors import UserError, VerifierDown
from hpc.fsio import unsafe_ancestor
from hpc.model.teacher import target_transform
from hpc.net import free_port
from hpc.proc import log_tail
from hpc.proc_guard import sweep_shm
from hpc.stream.sample import Capture
from hpc.verifier.target_files import final_norm_weight, text_config
from hpc.verifier.vllm_server import VLLMServer, config_flags, server_env, start_vllm_server

# capture_connector.py imports vllm, which lives only in vLLM's venv: refer to it by file and
# name here (tests/verifier/test_vllm_backend.py checks these match the module).
CONNECTOR_FILE = Path(__file__).with_name("capture_connector.py")
CONNECTOR_MODULE = "dspark_capture_connector"  # the name it is imported under inside vLLM
# Its torch-only helper, copied beside it under the name the connector imports.
COPY_FILE = Path(__file__).with_name("capture_copy.py")
COPY_MODULE = "dspark_capture_copy"
CONNECTOR_CLASS = "DSparkCaptureConnector"
PATH_KEY = "hidden_states_path"  # PATH_KEY


class CaptureError(RuntimeError):
    """One sample's capture failed (bad file, rejected prompt); other samples are unaffected.
    `transient`: it ran out of time (a slow request, a late file), which is no fault of the
    sample's: with the server alive it is tried again before the sample is given up."""

    def __init__(self, msg: str, transient: bool = False):
        super().__init__(msg)
        self.transient = transient


# A transient failure with the server alive is retried for verifier.capture_retry_s, pausing
# between tries (doubling, capped): a skipped sample is never trained, and a loaded server that
# answers one request late answers the next once the load passes.
RETRY_PAUSE_S, RETRY_PAUSE_MAX_S = 0.5, 10.0


def capture_layer_ids(aux_layer_ids: list[int], num_hidden_layers: int) -> list[int]:
    """What vLLM must capture: the aux ids and the final pre-norm output (id == num layers)."""
    bad = [i for i in aux_layer_ids if not 0 <= i <= num_hidden_layers]
    if bad:
        raise UserError(f"verifier.aux_layer_ids {bad} outside 0..{num_hidden_layers} (the target's layers)")
    return sorted(set(aux_layer_ids) | {num_hidden_layers})


def server_args(cfg: VerifierConfig, layer_ids: list[int], capture_dir: str | Path) -> list[str]:
    """Every vLLM flag from the config; `cfg.extra_args` come last, so they win."""
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}}}
    kv = {"kv_connector": CONNECTOR_CLASS, "kv_connector_module_path": CONNECTOR_MODULE,
          "kv_role": "kv_producer", "kv_connector_extra_config": {"capture_dir": str(capture_dir)}}
    return config_flags(cfg) + [
        "--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv),
        # A prefix-cache hit skips the forward of the shared prefix: safest to always recompute,
        # so every saved row comes from this request's own forward.
        "--no-enable-prefix-caching",
    ] + list(cfg.extra_args)


@dataclass
class CaptureServer:
    """A vLLM server with our connector, and the folders it owns (removed on stop)."""

    server: VLLMServer
    capture_dir: Path
    connector_dir: Path
    layer_ids: list[int]

    @property
    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        self.server.stop()
        shutil.rmtree(self.capture_dir, ignore_errors=True)
        shutil.rmtree(self.connector_dir, ignore_errors=True)

    def __enter__(self) -> CaptureServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def private_capture_dir(base: str | Path, port: int) -> Path:
    """A fresh 0700 directory of ours under `base` (node-local RAM, shared by every user of the
    node): nobody else can read, swap or plant capture files in it, and removing it at the end
    touches no other job's captures."""
    base = Path(base)
    if not base.is_dir():
        raise UserError(f"verifier.capture_dir = {str(base)!r}: no such directory on this node; "
                        "use /dev/shm or another node-local directory")
    if (why := unsafe_ancestor(base)) is not None:
        raise UserError(f"verifier.capture_dir = {str(base)!r}: {why}; use /dev/shm (root's, sticky) or a "
                        "directory of your own")

    sweep_shm(root=str(base))  # capture dirs whose starter was killed (the pid in the name is dead)
    job = os.environ.get("SLURM_JOB_ID", "local")
    # The starter's pid in the name: how a later start knows the directory's owner is gone.
    return Path(tempfile.mkdtemp(prefix=f"dspark-{os.getuid()}-{job}-pid{os.getpid()}-port{port}-", dir=base))


def start_capture_server(cfg: VerifierConfig, *, log_path: str | Path | None = None,
                         num_hidden_layers: int | None = None) -> CaptureServer:
    """Start vLLM from `cfg.python` with hidden-state capture; raises UserError if it never gets healthy."""
    n_layers = num_hidden_layers or _num_layers(cfg)
    layer_ids = capture_layer_ids(list(cfg.aux_layer_ids), n_layers)
    port = cfg.port or free_port(cfg.host)
    capture_dir = private_capture_dir(cfg.capture_dir, port)
    # The connector runs in vLLM's venv: put a copy of just that file on its PYTHONPATH.
    connector_dir = Path(tempfile.mkdtemp(prefix="dspark-connector-"))
    shutil.copy2(CONNECTOR_FILE, connector_dir / f"{CONNECTOR_MODULE}.py")
    shutil.copy2(COPY_FILE, connector_dir / f"{COPY_MODULE}.py")
    env = server_env(cfg)
    inherited = env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(connector_dir), inherited) if p)
    try:
        server = start_vllm_server(
            cfg.python, cfg.model, host=cfg.host, port=port, base_args=server_args(cfg, layer_ids, capture_dir),
            env=env, log_path=log_path, timeout=cfg.health_timeout_s, entrypoint=cfg.entrypoint,
            cleanup=(capture_dir, connector_dir))
    except BaseException:
        shutil.rmtree(capture_dir, ignore_errors=True)
        shutil.rmtree(connector_dir, ignore_errors=True)
        raise
    return CaptureServer(server, capture_dir, connector_dir, layer_ids)


def _num_layers(cfg: VerifierConfig) -> int:
    try:
        return int(text_config(cfg.model)["num_hidden_layers"])
    except UserError:  # config.json unreachable (e.g. login node): trust the config
        return cfg.num_hidden_layers


def wait_for_file(path: Path, timeout: float) -> None:
    """The connector writes the file after the response is sent; it appears by an atomic rename."""
    deadline = time.monotonic() + timeout
    delay = 0.002
    while not path.exists():
        error = Path(f"{path}.error")
        if error.exists():
            msg = error.read_text(errors="replace")
            error.unlink(missing_ok=True)
            raise CaptureError(f"the server failed to write {path}: {msg}")
        if time.monotonic() > deadline:
            raise CaptureError(f"capture file {path} did not appear within {timeout:.0f}s (is this "
                               "process on the vLLM server's node? the capture dir is node-local)", transient=True)
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def read_capture(path: Path, sample_id: int, input_ids: list[int], n_ids: int, hidden: int) -> torch.Tensor:
    """The [T, n_ids, H] hidden states of one capture file, checked against what was sent."""
    try:
        with safe_open(str(path), framework="pt") as fh:
            states = fh.get_tensor("hidden_states")
            token_ids = fh.get_tensor("token_ids")
    except (SafetensorError, OSError, KeyError, ValueError, RuntimeError) as err:
        size = path.stat().st_size if path.exists() else 0
        raise CaptureError(f"sample {sample_id}: capture file {path} ({size} bytes) is truncated or corrupt: "
                           f"{err}") from err
    T = len(input_ids)
    if tuple(states.shape) != (T, n_ids, hidden):
        raise CaptureError(f"sample {sample_id}: capture file {path} holds hidden states "
                           f"{tuple(states.shape)}, expected {(T, n_ids, hidden)}")
    if token_ids.tolist() != list(input_ids):
        raise CaptureError(f"sample {sample_id}: capture file {path} is for other token ids")
    return states


class VLLMVerifier:
    """Captures through a vLLM server: an existing one (`server`) or one it starts from `cfg`."""

    def __init__(self, cfg: VerifierConfig, server: CaptureServer | None = None, *,
                 request_timeout_s: float = 600.0, file_timeout_s: float = 120.0, probe_timeout_s: float = 5.0,
                 log_path: str | Path | None = None):
        self.cfg = cfg
        tcfg = text_config(cfg.model)
        self.n_layers = int(tcfg["num_hidden_layers"])
        self.hidden = int(tcfg["hidden_size"])
        self.transform = target_transform(cfg.model)  # the family's final norm (Gemma's is 1 + w)
        self.aux_layer_ids = list(cfg.aux_layer_ids)
        self.layer_ids = capture_layer_ids(self.aux_layer_ids, self.n_layers)
        self.final_hidden = FinalHidden(cfg.final_hidden)
        # vLLM gives the last layer's output BEFORE the final norm; the lm_head (and so the
        # training targets) sees it AFTER. For post_norm we apply the target's own norm weight.
        self.norm_weight = final_norm_weight(cfg.model) if self.final_hidden == FinalHidden.post_norm else None
        self.owns_server = server is None
        self.server = server or start_capture_server(cfg, log_path=log_path, num_hidden_layers=self.n_layers)
        if self.server.layer_ids != self.layer_ids:
            raise UserError(f"the vLLM server captures layers {self.server.layer_ids}, this verifier needs "
                            f"{self.layer_ids} (verifier.aux_layer_ids)")
        self.request_timeout_s = request_timeout_s
        self.file_timeout_s = file_timeout_s
        self.probe_timeout_s = probe_timeout_s  # /health, once a capture failed: is the server alive?
        # capture() runs in several threads at once (verifier.capture_concurrency): a session each.
        self._local = threading.local()
        self._sessions: list[requests.Session] = []
        # Capture files the wait gave up on: the connector writes after the response, so one may
        # land later, in node RAM (/dev/shm), where nothing else would ever delete it.
        self._abandoned: deque[Path] = deque(maxlen=4096)
        self._abandoned_lock = threading.Lock()

    @property
    def session(self) -> requests.Session:
        if not hasattr(self._local, "session"):
            self._local.session = requests.Session()
            self._local.session.headers.update(self.server.server.headers)
            self._sessions.append(self._local.session)
        return self._local.session

    def _prefill(self, sample_id: int, ids: list[int]) -> Path:
        """Send the known ids as the prompt; return the capture file's path."""
        # vLLM runs the capture model only while every sequence in the batch plus one token fits
        # max_model_len (and rejects such prompts anyway): say why here, for this sample only.
        if len(ids) + 1 > self.cfg.max_model_len:
            raise CaptureError(f"sample {sample_id}: {len(ids)} tokens, verifier.max_model_len "
                               f"{self.cfg.max_model_len} allows at most {self.cfg.max_model_len - 1}")
        body: dict[str, Any] = {"model": self.cfg.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0}
        try:
            resp = self.session.post(f"{self.server.url}/v1/completions", json=body, timeout=self.request_timeout_s)
        except requests.RequestException as err:
            raise CaptureError(f"sample {sample_id}: vLLM server at {self.server.url} unreachable: {err}",
                               transient=isinstance(err, (requests.Timeout, requests.ConnectionError))) from err
        if resp.status_code != 200:
            raise CaptureError(f"sample {sample_id}: vLLM answered {resp.status_code}: {resp.text[:500]}")
        params = resp.json().get("kv_transfer_params") or {}
        if PATH_KEY not in params:
            raise CaptureError(f"sample {sample_id}: no capture path in vLLM's answer (is the server running "
                               f"with the {CONNECTOR_CLASS}?): {str(resp.json())[:300]}")
        return self._own_capture_path(sample_id, params[PATH_KEY])

    def _own_capture_path(self, sample_id: int, reported: str) -> Path:
        """We read and then delete this file: only a file directly in our own capture dir."""
        path = Path(str(reported))
        root = self.server.capture_dir.resolve()
        if path.parent.resolve() != root or path.name.startswith(".") or path.is_symlink():
            raise CaptureError(f"sample {sample_id}: the server named a capture file outside this job's "
                               f"capture directory ({path}); refusing to read or delete it")
        return path

    def down(self) -> VerifierDown | None:
        """Why the server is gone, or None when it is alive and answers /health."""
        server = self.server.server
        if server.proc.poll() is None:
            try:
                if server.healthy(timeout=self.probe_timeout_s):
                    return None
            except UserError as err:  # the port is someone else's now
                return VerifierDown(str(err))
            try:  # a process being killed closes its sockets a moment before it can be reaped
                server.proc.wait(timeout=min(2.0, self.probe_timeout_s / 2))
            except subprocess.TimeoutExpired:
                return VerifierDown(f"vLLM at {server.url} does not answer /health (SIGSTOPped, deadlocked or "
                                    f"overloaded); see {server.log_path}", hung=True)
        return VerifierDown(f"vLLM exited with code {server.proc.returncode}; see {server.log_path}")

    def capture(self, sample_id: int, input_ids: list[int] | torch.Tensor, loss_mask) -> Capture:
        """One sample's states. A failure with the server alive and healthy is this sample's
        (CaptureError); one that only ran out of time (a loaded server) is tried again until
        verifier.capture_retry_s has passed. With the server gone or hung it is VerifierDown,
        which ends the stream."""
        ids = [int(i) for i in (input_ids.tolist() if torch.is_tensor(input_ids) else input_ids)]
        give_up = time.monotonic() + self.cfg.capture_retry_s
        attempt = 0
        while True:
            attempt += 1
            try:
                states = self._states(sample_id, ids)
                break
            except CaptureError as err:
                gone = self.down()
                if gone is not None:
                    raise gone from err
                left = give_up - time.monotonic()
                if not err.transient or left <= 0:
                    raise
                pause = min(RETRY_PAUSE_S * 2 ** (attempt - 1), RETRY_PAUSE_MAX_S, left)
                print(f"verifier: {err}; the server answers /health, trying again in {pause:.1f} s "
                      f"(attempt {attempt + 1}; verifier.capture_retry_s={self.cfg.capture_retry_s:g} "
                      f"leaves {left:.0f} s)", flush=True)
                time.sleep(pause)
        col = {layer: i for i, layer in enumerate(self.layer_ids)}
        # In the capture's dtype (bf16 from a GPU vLLM): the stream casts once, when it sends, and
        # the norm below rounds where the target's own module rounds.
        out = states[:, [col[i] for i in self.aux_layer_ids] + [col[self.n_layers]]]
        if self.norm_weight is not None:  # the last column becomes the post-norm hidden
            out[:, -1] = self.transform.final_norm(out[:, -1], self.norm_weight)
        return Capture.from_states(sample_id, torch.tensor(ids, dtype=torch.long),
                                   torch.as_tensor(loss_mask, dtype=torch.long), out)

    def _states(self, sample_id: int, ids: list[int]) -> torch.Tensor:
        self._sweep_abandoned()
        path, arrived = None, False
        try:
            path = self._prefill(sample_id, ids)
            wait_for_file(path, self.file_timeout_s)
            arrived = True
            return read_capture(path, sample_id, ids, len(self.layer_ids), self.hidden)
        finally:
            if path is not None:
                path.unlink(missing_ok=True)  # node RAM: the streamer sends right after, keep nothing
                if not arrived:
                    with self._abandoned_lock:
                        self._abandoned.append(path)

    def server_log_tail(self, lines: int = 20) -> str:
        return log_tail(self.server.server.log_path, lines)

    def _sweep_abandoned(self) -> None:
        """Delete the abandoned capture files that have landed since; keep looking for the rest."""
        with self._abandoned_lock:
            waiting = list(self._abandoned)
            self._abandoned.clear()
            for path in waiting:
                landed = [p for p in (path, Path(f"{path}.error")) if p.exists()]
                for p in landed:
                    p.unlink(missing_ok=True)
                if not landed:
                    self._abandoned.append(path)

    def close(self) -> None:
        self._sweep_abandoned()
        for s in self._sessions:
            s.close()
        if self.owns_server:
            self.server.stop()

    def __enter__(self) -> VLLMVerifier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
