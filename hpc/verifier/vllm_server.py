"""An OpenAI-compatible vLLM server in a subprocess, driven from another interpreter.

The server runs from the vLLM venv (see vllm_env.py) in its own process group, so stopping it
also stops the engine-core processes it forks. Readiness is `/health` answering 200; a server
that never gets there raises UserError with the tail of its log, which is where the cause is.

On a shared node, other users can reach the port. Each server gets a random API key (through
the environment, since argv is world-readable in `ps`), which our clients send; and the server
counts as ready only when the port it answers on is held by our own process tree. vLLM binds
its port only after loading the model, so without that check another user's process bound to
the port in the meantime would answer `/health` and then our requests.

    with start_vllm_server(python, model_dir) as server:
        requests.post(f"{server.url}/v1/completions", json={...})
"""

from __future__ import annotations

import getpass
import json
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from hpc.config.secrets import redact_args
from hpc.errors import UserError
from hpc.net import free_port
from hpc.own_env import foreign_environ
from hpc.proc import SubprocessServer, http_ok, spawn
from hpc.proc_guard import sweep_shm
from hpc.verifier import vllm_auth

if TYPE_CHECKING:
    from hpc.config.schema import VerifierConfig

# CPU-safe defaults: vLLM sees ~10 GiB on a small host and refuses its default 0.92 utilisation;
# cudagraph capture does not apply on CPU.
DEFAULT_ARGS = ["--dtype", "float32", "--enforce-eager", "--gpu-memory-utilization", "0.5"]
DEFAULT_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}  # read by the CPU backend only


def config_flags(v: VerifierConfig) -> list[str]:
    """The vLLM flags every server of ours takes from a VerifierConfig (model shape, parallelism,
    memory, tokenizer, compilation); each caller adds its own and then `v.extra_args`, last."""
    args = ["--dtype", v.dtype, "--max-model-len", str(v.max_model_len),
            "--tensor-parallel-size", str(v.tensor_parallel_size),
            "--gpu-memory-utilization", str(v.gpu_memory_utilization)]
    if v.tokenizer:
        args += ["--tokenizer", v.tokenizer]
    if v.trust_remote_code:
        args.append("--trust-remote-code")
    if v.compilation_config:
        args += ["--compilation-config", json.dumps(dict(v.compilation_config))]
    return args


def server_env(v: VerifierConfig) -> dict[str, str]:
    """The environment a server of ours gets from a VerifierConfig: `v.env`, plus offline mode
    when the config sets it (otherwise the caller's environment decides, never us)."""
    env = dict(v.env)
    if v.offline is not None:
        env["HF_HUB_OFFLINE"] = "1" if v.offline else "0"
    return env


def port_owned_by(pid: int, port: int) -> bool:
    """Whether `pid` or one of its descendants listens on TCP `port`."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return False
    for proc in procs:
        try:
            if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                   for c in proc.net_connections(kind="tcp")):
                return True
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return False


@dataclass
class VLLMServer(SubprocessServer):
    proc: subprocess.Popen
    host: str
    port: int
    model: str
    log_path: Path
    api_key: str | None = None
    started_at: float = field(default_factory=time.monotonic)
    rpc_dir: Path | None = None  # holds vLLM's ZMQ sockets; removed when the server stops
    plugin_dir: Path | None = None  # our middleware module on vLLM's PYTHONPATH; removed too
    tmp_dir: Path | None = None  # vLLM's TMPDIR; removed too

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def what(self) -> str:
        return f"vLLM server for {self.model}"

    @property
    def headers(self) -> dict[str, str]:
        """What every request to this server carries."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def healthy(self, timeout: float = 2.0) -> bool:
        ok = http_ok(f"{self.url}/health", timeout)
        if ok and not port_owned_by(self.proc.pid, self.port):
            raise UserError(f"another process answers on {self.host}:{self.port}, not our vLLM server; "
                            "leave verifier.port=0 (a free port per server) or pick a port nobody uses")
        return ok

    def __enter__(self) -> VLLMServer:
        return self

    def stop(self, grace: float | None = None) -> None:
        super().stop(grace)
        for d in (self.rpc_dir, self.plugin_dir, self.tmp_dir):
            if d is not None:
                shutil.rmtree(d, ignore_errors=True)
        sweep_shm(min_age_s=5.0)  # a server SIGKILLed after the grace leaves its segments behind


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container): inductor's own fallback
        return "unknown"


def start_vllm_server(
    python: str | Path,
    model: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    extra_args: list[str] | tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    log_path: str | Path | None = None,
    timeout: float = 300.0,
    wait: bool = True,
    base_args: list[str] | tuple[str, ...] | None = None,
    entrypoint: str = "vllm.entrypoints.openai.api_server",
    api_key: str | None = None,
    cleanup: tuple[Path, ...] = (),
) -> VLLMServer:
    """Start `vllm.entrypoints.openai.api_server` (``vllm serve`` fails for vllm-cpu) and wait for it.

    ``base_args`` replaces the CPU defaults (DEFAULT_ARGS) for callers that build every flag from
    a config, e.g. a GPU node, where ``--enforce-eager`` would cost throughput and cannot be undone.
    ``cleanup``: the caller's temp paths for this server, removed if the caller dies (proc_guard).
    """
    sweep_shm()  # what servers of ours that were killed left in /dev/shm, before this one adds to it
    port = port or free_port(host)
    # vLLM guards only some routes with its key (vllm_auth says which not): ours guards them all.
    plugin_dir = Path(tempfile.mkdtemp(prefix="dspark-vllm-plugins-"))
    shutil.copy2(vllm_auth.__file__, plugin_dir / f"{vllm_auth.MODULE}.py")
    if log_path is None:
        log_path = Path(tempfile.mkdtemp(prefix="dspark-vllm-")) / "server.log"
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        os.path.expanduser(str(python)), "-m", entrypoint, "--model", str(model),
        "--host", host, "--port", str(port), *(DEFAULT_ARGS if base_args is None else base_args), *extra_args,
        "--middleware", f"{vllm_auth.MODULE}.KeyOnEveryRoute",
    ]
    # The caller's venv must not leak into vLLM's interpreter, nor our ranks' variables (hpc.own_env);
    # PYTHONPATH stays (our own plugins, e.g. a KV connector module, are imported from it).
    full_env = {k: v for k, v in foreign_environ().items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    full_env.update({**DEFAULT_ENV, **(env or {})})
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(plugin_dir), full_env.get("PYTHONPATH", "")) if p)
    api_key = api_key or secrets.token_urlsafe(32)
    full_env["VLLM_API_KEY"] = api_key
    # vLLM names a ZMQ socket file per engine in the temp dir and leaves it there when the
    # server stops: a node (or a CI day) gathers thousands. Give each server its own dir.
    rpc_dir = None
    if "VLLM_RPC_BASE_PATH" not in full_env:
        rpc_dir = Path(tempfile.mkdtemp(prefix="dspark-vllm-rpc-"))
        full_env["VLLM_RPC_BASE_PATH"] = str(rpc_dir)
    # Its multiprocess executor rendezvous through a vllm_dist_<uuid> file in the temp dir, which
    # stays when the server is stopped. Inductor's cache stays where it was: it is worth keeping.
    tmp_dir = Path(tempfile.mkdtemp(prefix="dspark-vllm-tmp-"))
    full_env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / f"torchinductor_{_user()}"))
    full_env["TMPDIR"] = str(tmp_dir)

    proc = spawn(cmd, log_path, env=full_env, shown=redact_args(list(cmd)),
                 cleanup=[plugin_dir, tmp_dir, *([rpc_dir] if rpc_dir else []), *cleanup])
    server = VLLMServer(proc=proc, host=host, port=port, model=str(model), log_path=log_path, api_key=api_key,
                        rpc_dir=rpc_dir, plugin_dir=plugin_dir, tmp_dir=tmp_dir)
    if wait:
        server.wait_healthy(timeout)
    return server
