"""Regeneration across the nodes of an allocation: one vLLM server per node, as Ray actors.

Each node of the Ray cluster offers one unit of REGEN_RESOURCE, so `servers` actors land on
`servers` different nodes. An actor starts vLLM on its own node's 127.0.0.1 and answers chat
requests there; the driver's RayChatClient sends each request to the least-busy live actor.
RayChatClient has ChatClient's shape, so `regenerate()` (input order, shards, resume, the
progress line) runs unchanged on top of it:

    stats = regenerate_on_ray(cfg, servers=4, log=print)   # after ray.init(address=...)

A node whose server dies costs only the requests in flight there: they are retried on the
other nodes, and the run goes on with those.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpc.config.schema import DSparkConfig
from hpc.data.regen_client import ChatClient, Reply, RequestFailed, served_model
from hpc.data.regenerate import start_regen_server
from hpc.errors import UserError

REGEN_RESOURCE = "dspark_regen"  # one unit per Ray node: one server per node


class RegenServer:
    """A Ray actor: vLLM on this node (or an existing server at `url`), behind a ChatClient."""

    def __init__(self, cfg: DSparkConfig, log_dir: str, url: str | None = None):
        # On a Slurm node the task's environment reaches Ray's workers: name the node as Slurm does.
        self.host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        self.server = None
        key = os.environ.get("VLLM_API_KEY") if url is not None else None
        if url is None:
            import ray  # ray: loaded only on this path

            node = ray.get_runtime_context().get_node_id()[:8]
            log = Path(log_dir) / f"regenerate-vllm-{self.host}-{node}.log"
            self.server = start_regen_server(cfg.verifier, log_path=log)
            url, key = self.server.url, self.server.api_key
        self.client = ChatClient(url, served_model(url, api_key=key), cfg.data.regen_max_tokens,
                                 cfg.data.regen_temperature, api_key=key)

    def info(self) -> tuple[str, str]:
        """(host, served model): also the readiness probe, as the constructor waited for health."""
        return self.host, self.client.model

    def complete(self, messages: list[dict], seed: int | None) -> tuple:
        # Outcomes travel as plain tuples: Ray re-raises remote exceptions wrapped, and a wrapped
        # RequestFailed would lose its reason (the skip counter).
        try:
            reply = self.client.complete(messages, seed)
        except RequestFailed as err:
            if self.server is not None and self.server.proc.poll() is not None:
                # vLLM is gone but this actor lives: the row must go to another node, not be skipped.
                return ("dead", "server_died", f"vLLM exited with {self.server.proc.returncode}; "
                                               f"see {self.server.log_path}")
            return ("failed", err.reason, err.detail)
        return ("ok", reply.content, reply.truncated)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


class RayChatClient:
    """ChatClient's interface over several RegenServer actors, least-busy first."""

    def __init__(self, actors: list, names: list[str], model: str, max_tokens: int, temperature: float,
                 log: Callable[[str], None] = print):
        self.actors, self.names = list(actors), list(names)
        self.model, self.max_tokens, self.temperature = model, max_tokens, temperature
        self.busy = [0] * len(self.actors)
        self.served = [0] * len(self.actors)
        self.alive = [True] * len(self.actors)
        self._lock = threading.Lock()
        self._log = log

    def _pick(self) -> int | None:
        with self._lock:
            live = [i for i, ok in enumerate(self.alive) if ok]
            if not live:
                return None
            i = min(live, key=lambda j: (self.busy[j], self.served[j]))
            self.busy[i] += 1
            return i

    def complete(self, messages: list[dict], seed: int | None = None) -> Reply:
        import ray  # ray: loaded only on this path
        from ray.exceptions import RayActorError  # ray: loaded only on this path

        while (i := self._pick()) is not None:
            try:
                status, a, b = ray.get(self.actors[i].complete.remote(messages, seed))
            except RayActorError as err:
                status, b = "dead", f"{type(err).__name__}"
            finally:
                with self._lock:
                    self.busy[i] -= 1
            if status == "dead":
                self._mark_dead(i, b)
                continue
            if status == "ok":
                with self._lock:
                    self.served[i] += 1
                return Reply(a, b)
            raise RequestFailed(a, b)
        # Not a skipped row: no shard may record rows that were never asked of any server.
        raise UserError(f"no regeneration server is left alive ({self.summary()}); re-run to resume")

    def _mark_dead(self, i: int, why: str) -> None:
        with self._lock:
            first = self.alive[i]
            self.alive[i] = False
        if first:
            self._log(f"regenerate: the server on {self.names[i]} is gone ({why[:200]}); "
                      f"its requests go to the {sum(self.alive)} other(s)")

    def summary(self) -> str:
        return ", ".join(f"{n} {s}" + ("" if ok else " (died)")
                         for n, s, ok in zip(self.names, self.served, self.alive))


def start_servers(cfg: DSparkConfig, servers: int, log_dir: Path, concurrency: int, url: str | None = None,
                  timeout_s: float | None = None, log: Callable[[str], None] = print) -> RayChatClient:
    """`servers` RegenServer actors, one per node; goes on with those that came up (at least one)."""
    import ray  # ray: loaded only on this path
    from ray.exceptions import GetTimeoutError, RayActorError  # ray: loaded only on this path

    actor_cls = ray.remote(RegenServer).options(num_cpus=0, resources={REGEN_RESOURCE: 1},
                                                max_concurrency=max(1, concurrency))
    # Any: Ray types an actor's methods as plain methods (no `.remote`) unless each is @ray.method.
    actors: list[Any] = [actor_cls.remote(cfg, str(log_dir), url) for _ in range(servers)]
    # One deadline for all: the servers start in parallel, each on its own node.
    deadline = time.monotonic() + (timeout_s if timeout_s is not None else cfg.verifier.health_timeout_s + 120)
    ready: list[Any] = []
    names: list[str] = []
    failures: list[str] = []
    for k, actor in enumerate(actors):
        try:
            host, model = ray.get(actor.info.remote(), timeout=max(1.0, deadline - time.monotonic()))
        except (RayActorError, GetTimeoutError) as err:
            failures.append(f"server {k}: {type(err).__name__}: {str(err).strip().splitlines()[-1][:300]}")
            ray.kill(actor)
            continue
        ready.append(actor)
        names.append(host if host not in names else f"{host}#{len(names)}")
    if not ready:
        raise UserError(f"no regeneration server came up on any of {servers} node(s); the vLLM logs are in "
                        f"{log_dir}:\n  " + "\n  ".join(failures))
    for line in failures:
        log(f"regenerate: warning: {line}; going on with {len(ready)} server(s)")
    log(f"regenerate: {len(ready)} vLLM server(s) up ({', '.join(names)}), {concurrency} requests in flight each")
    return RayChatClient(ready, names, model, cfg.data.regen_max_tokens, cfg.data.regen_temperature, log)


def stop_servers(client: RayChatClient) -> None:
    import ray  # ray: loaded only on this path

    for actor, ok in zip(client.actors, client.alive):
        if ok:
            try:
                ray.get(actor.stop.remote(), timeout=60)
            except Exception:  # noqa: BLE001 - it is going away either way
                pass
        ray.kill(actor)
