"""A Ray cluster over the nodes of one Slurm allocation (the regeneration job).

Node 0 runs `ray start --head --block`, every other node `ray start --address=HEAD:PORT --block`,
each as a child of the node's task. Node 0 picks the GCS port (a free one on its own address)
and every other port is left to the OS, so two raylets can share a host: two jobs on one
node, or the dev cluster's loopback fallback, where all "nodes" are one machine. Each node offers one
unit of REGEN_RESOURCE, which places one vLLM server per node.

The GCS listens on the node's address (the other nodes must reach it), so the cluster runs with
Ray's token authentication on: node 0 draws a token per job (and restart) and publishes it with
the port in one owner-only file on the shared filesystem (hpc.launch.job_files), where the
other nodes read it. Ray does not own the GPUs here:
RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES keeps the devices Slurm gave the task, so the
node's vLLM sees all of them.

Node 0 drives; the others serve until its "done" marker appears on the shared filesystem (or
their raylet goes away with the head) and then end with exit 0: a worker's failure is node 0's
to handle (its requests move to the other servers), never a reason to fail the job. The marker
and the token carry the restart count, so a requeued job sees neither of the last attempt's.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from hpc.data.regen_ray import REGEN_RESOURCE
from hpc.errors import UserError
from hpc.launch.job_files import attempt as job_attempt
from hpc.launch.job_files import job_file, publish, visible, wait_published
from hpc.launch.slurm_env import SlurmEnv, advertised_ip, node_ip
from hpc.net import free_port

TAG = "DSPARK_RAY_NODE"  # in the environment of everything a node's raylet starts, vLLM included


def ray_start_command(env: SlurmEnv, port: int, *, object_store_mb: int, temp_dir: str | None = None) -> list[str]:
    ray_bin = Path(sys.executable).with_name("ray")
    cmd = [str(ray_bin), "start", "--block", "--disable-usage-stats", "--node-ip-address", advertised_ip(env),
           "--resources", json.dumps({REGEN_RESOURCE: 1}), "--object-store-memory", str(object_store_mb * 2**20),
           "--min-worker-port", "0", "--max-worker-port", "0", "--dashboard-agent-listen-port", "0"]
    if env.node_index == 0:
        cmd += ["--head", "--port", str(port), "--include-dashboard", "false"]
    else:
        cmd += ["--address", f"{node_ip(env.hostnames[0])}:{port}"]
    return cmd + (["--temp-dir", temp_dir] if temp_dir else [])


def attempt(env: SlurmEnv) -> str:
    """This run of the job: a requeue is a new attempt, with its own marker, token and tag."""
    return job_attempt(env.job_id)


def done_marker(root: Path, env: SlurmEnv) -> Path:
    return root / f".ray-done-{attempt(env)}"


class RayNode:
    """This node's raylet (and on node 0 the head), started under this process.

    `late` is set on a worker node that arrived after node 0 had finished: nothing is started.
    """

    def __init__(self, env: SlurmEnv, log_path: Path, *, object_store_mb: int = 512, token_timeout_s: float = 600):
        self.env, self.log_path = env, log_path
        self.marker = done_marker(log_path.parent, env)
        self.token_file = job_file(log_path.parent, "ray-token", env.job_id)
        self.tag = f"{attempt(env)}-{env.node_index}-{os.getpid()}"
        self.proc: subprocess.Popen | None = None
        self.private: Path | None = None
        log_path.parent.mkdir(parents=True, exist_ok=True)
        head = self._head(token_timeout_s)
        self.late = head is None
        self.auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": head["token"] if head else ""}
        self.port = int(head["port"]) if head else 0
        if self.late:
            return
        # Every node's temp dir sits inside one only we can enter: Ray takes a directory someone
        # made first as it is, then makes it 0777 (a worker without one takes the head's path).
        # In /tmp itself, not $TMPDIR: Ray's unix socket paths must stay under 108 bytes.
        self.private = Path(tempfile.mkdtemp(prefix=f"dsr-{env.job_id}-", dir="/tmp"))
        self.cmd = ray_start_command(env, self.port, object_store_mb=object_store_mb, temp_dir=str(self.private / "r"))
        child_env = dict(os.environ, RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES="1", RAY_USAGE_STATS_ENABLED="0",
                         **{TAG: self.tag}, **self.auth)
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env,
                                         start_new_session=True)

    def _head(self, timeout_s: float) -> dict | None:
        """The head's GCS port and the job's Ray token: node 0 picks both (a free port on its own
        address), every node reads them from one owner-only file; None if node 0 came and went."""
        if self.env.node_index == 0:
            publish(self.token_file, {"port": free_port(advertised_ip(self.env)), "token": secrets.token_hex(32)})
        return wait_published(self.token_file, timeout_s, "node 0", gone=self.marker)

    @property
    def address(self) -> str:
        return f"{node_ip(self.env.hostnames[0])}:{self.port}"

    def connect(self, n_nodes: int, timeout_s: float) -> None:
        """ray.init against the head, then wait until every node's raylet has joined."""
        import ray  # ray: loaded only on this path

        os.environ.update(self.auth)  # this process is a Ray driver too
        _refresh_ray_auth()
        deadline = time.monotonic() + timeout_s
        while True:  # the head may still be starting
            self._check_alive()
            try:
                ray.init(address=self.address, _node_ip_address=advertised_ip(self.env),
                         logging_level=logging.WARNING, log_to_driver=False)
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
        if self.proc is not None and self.proc.poll() is not None:
            raise UserError(f"`ray start` exited with code {self.proc.returncode} on node {self.env.node_index}; "
                            f"see {self.log_path}")

    def serve(self, poll_s: float = 2.0, grace_s: float = 60.0) -> str:
        """A worker node: serve until node 0 is done; says how it ended. A raylet that exits (the head
        went away, or it crashed) leaves `grace_s` for the marker to show through the FS cache."""
        ended = None
        while not visible(self.marker):
            if self.proc is None:
                break
            if ended is None and self.proc.poll() is not None:
                ended = time.monotonic()
            if ended is not None and time.monotonic() - ended > grace_s:
                return f"the raylet exited (code {self.proc.returncode}) and node 0 left no done marker; see {self.log_path}"
            time.sleep(poll_s)
        return "node 0 is done"

    def stop(self) -> None:
        """Stop the raylet and everything it started. Found by TAG, not by parentage: a vLLM whose
        actor was killed has been reparented, and Ray's agents outlive `ray start` if left alone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # `ray start --block` drains and stops its processes on SIGTERM
            try:
                self.proc.wait(45)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        kill_tagged(self.tag)
        if self.env.node_index == 0:
            self.token_file.unlink(missing_ok=True)
        if self.private is not None:
            shutil.rmtree(self.private, ignore_errors=True)


def kill_tagged(tag: str) -> int:
    killed = 0
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get(TAG) == tag:
                p.kill()
                killed += 1
        except psutil.Error:
            pass
    return killed


def _refresh_ray_auth() -> None:
    """Ray caches the auth mode and token when it is first imported; make it read the environment again."""
    try:
        # In the compiled module, not in Ray's _raylet.pyi stub.
        from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]
    except ImportError:  # another Ray: it reads the environment at ray.init
        return
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
