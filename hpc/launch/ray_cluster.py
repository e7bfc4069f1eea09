"""A Ray cluster over the nodes of one Slurm allocation (the regeneration job).

Node 0 runs `ray start --head --block`, every other node `ray start --address=HEAD:PORT --block`,
each as a child of the node's task, so a raylet never outlives its job step. The GCS port
derives from the job id (like the torch rendezvous port) and every other port is left to the OS,
so two raylets can share a host: two jobs on one node, or the dev cluster, where all "nodes"
are one machine. Each node offers one unit of REGEN_RESOURCE, which places one vLLM server per node.

The GCS listens on the node's address (the other nodes must reach it), so the cluster runs with
Ray's token authentication on: node 0 draws a token per job (and restart) and leaves it, mode
0600, on the shared filesystem, where the other nodes read it. Ray does not own the GPUs here: RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES keeps the devices
Slurm gave the task, so the node's vLLM sees all of them.

Node 0 drives; the others wait for its "done" marker on the shared filesystem and then stop
their raylet. The marker carries the restart count, so a requeued job does not see the last one.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from hpc.errors import UserError
from hpc.launch.stages import SlurmEnv, rendezvous_port
from hpc.verifier.regen_ray import REGEN_RESOURCE



def ray_port(job_id: int) -> int:
    """The head's GCS port: below the torch rendezvous range (20000-39999), so one node may hold both."""
    return rendezvous_port(job_id, base=10000, span=10000)


def node_ip(hostname: str) -> str:
    try:
        return socket.gethostbyname(hostname)
    except OSError as err:
        raise UserError(f"cannot resolve node {hostname!r} ({err}); Ray needs every node's address") from err


def ray_start_command(env: SlurmEnv, *, object_store_mb: int) -> list[str]:
    ray_bin = Path(sys.executable).with_name("ray")
    head_ip = node_ip(env.hostnames[0])
    me = env.hostnames[env.node_index] if env.node_index < len(env.hostnames) else socket.gethostname()
    cmd = [str(ray_bin), "start", "--block", "--disable-usage-stats", "--node-ip-address", node_ip(me),
           "--resources", json.dumps({REGEN_RESOURCE: 1}), "--object-store-memory", str(object_store_mb * 2**20),
           "--min-worker-port", "0", "--max-worker-port", "0", "--dashboard-agent-listen-port", "0"]
    if env.node_index == 0:
        # A short, job-owned temp dir: Ray's unix socket paths must stay under ~107 characters.
        cmd += ["--head", "--port", str(ray_port(env.job_id)), "--include-dashboard", "false",
                "--temp-dir", f"/tmp/dspark-ray-{env.job_id}"]
    else:
        cmd += ["--address", f"{head_ip}:{ray_port(env.job_id)}"]
    return cmd


class RayNode:
    """This node's raylet (and on node 0 the head), started under this process."""

    def __init__(self, env: SlurmEnv, log_path: Path, *, object_store_mb: int = 512, token_timeout_s: float = 600):
        self.env = env
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.token_file = log_path.parent / f".ray-token-{env.job_id}-{os.environ.get('SLURM_RESTART_COUNT', '0')}"
        self.auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self._token(token_timeout_s)}
        self._log = open(log_path, "ab")
        child_env = dict(os.environ, RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES="1", RAY_USAGE_STATS_ENABLED="0",
                         **self.auth)
        self.cmd = ray_start_command(env, object_store_mb=object_store_mb)
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=child_env,
                                     start_new_session=True)

    def _token(self, timeout_s: float) -> str:
        if self.env.node_index == 0:
            tmp = self.token_file.with_name(self.token_file.name + f".tmp-{os.getpid()}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
            tmp.replace(self.token_file)
        deadline = time.monotonic() + timeout_s
        while not self.token_file.exists():
            if time.monotonic() > deadline:
                raise UserError(f"node 0 left no Ray token in {timeout_s:.0f}s ({self.token_file}); see node 0's log")
            time.sleep(1)
        return self.token_file.read_text().strip()

    @property
    def address(self) -> str:
        return f"{node_ip(self.env.hostnames[0])}:{ray_port(self.env.job_id)}"

    def connect(self, n_nodes: int, timeout_s: float) -> None:
        """ray.init against the head, then wait until every node's raylet has joined."""
        import ray

        me = self.env.hostnames[self.env.node_index] if self.env.node_index < len(self.env.hostnames) else None
        deadline = time.monotonic() + timeout_s
        os.environ.update(self.auth)  # this process is a Ray driver too
        _refresh_ray_auth()
        while True:  # the head may still be starting
            self._check_alive()
            try:
                ray.init(address=self.address, _node_ip_address=node_ip(me) if me else None,
                         logging_level="WARNING", log_to_driver=False)
                break
            except (ConnectionError, RuntimeError):
                if time.monotonic() > deadline:
                    raise UserError(f"the Ray head at {self.address} did not come up in {timeout_s:.0f}s; "
                                    f"see {self.log_path}") from None
                time.sleep(2)
        while (joined := int(ray.cluster_resources().get(REGEN_RESOURCE, 0))) < n_nodes:
            self._check_alive()
            if time.monotonic() > deadline:
                raise UserError(f"only {joined} of {n_nodes} nodes joined the Ray cluster in {timeout_s:.0f}s; "
                                f"see the ray-*.log files next to {self.log_path}")
            time.sleep(1)

    def _check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise UserError(f"`ray start` exited with code {self.proc.returncode} on node {self.env.node_index}; "
                            f"see {self.log_path}")

    def wait_for(self, marker: Path, poll_s: float = 2.0) -> None:
        """A worker node: serve until node 0 writes `marker` (or this raylet dies)."""
        while not marker.exists():
            self._check_alive()
            time.sleep(poll_s)

    def stop(self) -> None:
        """Stop the raylet and everything it started: agents outlive `ray start` if left alone."""
        import psutil

        try:
            family = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            family = []
        if self.proc.poll() is None:
            self.proc.terminate()  # `ray start --block` drains and stops its processes on SIGTERM
            try:
                self.proc.wait(45)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for p in family:
            try:
                p.kill()
            except psutil.Error:
                pass
        self._log.close()
        if self.env.node_index == 0:
            self.token_file.unlink(missing_ok=True)


def _refresh_ray_auth() -> None:
    """Ray caches the auth mode and token when it is first imported; make it read the environment again."""
    try:
        from ray._raylet import AuthenticationTokenLoader, Config
    except ImportError:  # another Ray: it reads the environment at ray.init
        return
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def done_marker(root: Path, env: SlurmEnv) -> Path:
    return root / f".ray-done-{env.job_id}-{os.environ.get('SLURM_RESTART_COUNT', '0')}"
