"""MLflow logging that never stalls or kills a training job.

Metrics go into a queue; a background thread ships them in batches. If the tracking server
is down, nothing is lost: the batch stays in the buffer (and the run itself is created late,
once the server answers) and is flushed when the server is back. Training never waits on HTTP.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import psutil

from hpc.config.secrets import scrub
from hpc.track.keys import PARENT_RUN_ID, RUN_NAME
from hpc.track.pipeline import experiment_id

# A dead server must fail fast in the background thread, not retry for minutes. The timeout is
# the whole process's (MLflow reads it per request): a job's direct calls (an eval's metrics) get
# it too, so it must outlast a live server that is slow under load. At 5 s, the adaptive eval's
# log_metric timed out against the tracking server while two vLLM servers held both cores.
# `close` bounds the wait for the last flush on its own.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")


@dataclass
class _Pending:
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    metrics: deque = field(default_factory=deque)  # (key, value, timestamp_ms, step)
    artifacts: list[tuple[str, str | None]] = field(default_factory=list)


class RunLogger:
    def __init__(self, uri: str, experiment: str, run_name: str, parent_run_id: str | None = None,
                 tags: dict[str, str] | None = None, flush_every_s: float = 2.0, run_id: str | None = None,
                 system_every_s: float | None = 10.0):
        from mlflow.tracking import MlflowClient  # mlflow: loaded only on this path

        self.client = MlflowClient(uri)
        self.experiment, self.run_name, self.parent_run_id = experiment, run_name, parent_run_id
        self.run_id = run_id
        self.pending = _Pending(tags=dict(tags or {}))
        self.flush_every_s = flush_every_s
        self.last_error: str | None = None
        self.flushed_metrics = 0
        self.system_every_s = system_every_s
        self._last_system = 0.0
        self._last_step = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    # -- the training thread's side: O(1), no I/O ------------------------------------------------
    def log_params(self, params: dict) -> None:
        with self._lock:
            self.pending.params.update({k: str(v)[:6000] for k, v in params.items()})

    def set_tags(self, tags: dict) -> None:
        with self._lock:
            self.pending.tags.update({k: str(v) for k, v in tags.items()})

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        with self._lock:
            self._last_step = step
            for k, v in metrics.items():
                self.pending.metrics.append((k, float(v), now, step))

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        with self._lock:
            self.pending.artifacts.append((str(path), artifact_path))

    # -- background ------------------------------------------------------------------------------
    def _ensure_run(self) -> str:
        if self.run_id is not None:
            return self.run_id

        exp_id = experiment_id(self.client, self.experiment)
        tags = {RUN_NAME: self.run_name}
        if self.parent_run_id:
            tags[PARENT_RUN_ID] = self.parent_run_id
        self.run_id = self.client.create_run(exp_id, tags=tags, run_name=self.run_name).info.run_id
        return self.run_id

    def flush(self) -> bool:
        """Ship what is buffered; False (and everything kept) if the server did not take it."""
        from mlflow.entities import Metric, Param, RunTag  # mlflow: loaded only on this path

        with self._lock:
            params, tags = dict(self.pending.params), dict(self.pending.tags)
            metrics = list(self.pending.metrics)[:1000]
            artifacts = list(self.pending.artifacts)
        try:
            run_id = self._ensure_run()
            if params or tags or metrics:
                self.client.log_batch(run_id, metrics=[Metric(k, v, ts, s) for k, v, ts, s in metrics],
                                      params=[Param(k, v) for k, v in params.items()],
                                      tags=[RunTag(k, v) for k, v in tags.items()])
            for path, artifact_path in artifacts:
                self.client.log_artifact(run_id, path, artifact_path)
        except Exception as err:  # noqa: BLE001 - any failure means: keep the buffer, retry later
            self.last_error = scrub(str(err).splitlines()[0])[:200]
            return False
        with self._lock:
            for k in params:
                if self.pending.params.get(k) == params[k]:
                    del self.pending.params[k]
            for k in tags:
                if self.pending.tags.get(k) == tags[k]:
                    del self.pending.tags[k]
            for _ in metrics:
                self.pending.metrics.popleft()
            del self.pending.artifacts[:len(artifacts)]
        self.flushed_metrics += len(metrics)
        self.last_error = None
        return True

    @property
    def buffered(self) -> int:
        with self._lock:
            return len(self.pending.metrics)

    def _sample_system(self) -> None:
        """CPU, memory and GPU memory of this node, through the same outage-proof buffer."""
        vm = psutil.virtual_memory()
        values = {"system/cpu_percent": psutil.cpu_percent(interval=None),
                  "system/memory_used_gb": (vm.total - vm.available) / 1e9,
                  "system/process_rss_gb": psutil.Process().memory_info().rss / 1e9}
        try:
            import torch  # optional here: without it (a login node) there are no GPU metrics

            for i in range(torch.cuda.device_count()):
                values[f"system/gpu{i}_memory_allocated_gb"] = torch.cuda.memory_allocated(i) / 1e9
        except Exception:  # noqa: BLE001 - no GPU metrics is not a reason to lose the others
            pass
        self.log_metrics(values, self._last_step)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.flush_every_s)
            self._wake.clear()
            if self.system_every_s and time.monotonic() - self._last_system >= self.system_every_s:
                self._last_system = time.monotonic()
                self._sample_system()
            while self.buffered and self.flush():  # drain in batches while the server takes them
                pass
            if not self.buffered:
                self.flush()  # params/tags/artifacts without metrics

    @property
    def closed(self) -> bool:
        """`close` has been called: the run's end status is set (or being set) there."""
        return self._stop.is_set()

    def close(self, timeout_s: float = 30.0, status: str | None = None) -> bool:
        """Stop the thread after a last flush, then end the run as `status` (FINISHED, FAILED or
        KILLED), so no run stays RUNNING; True if nothing is left unsent."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)
        deadline = time.monotonic() + timeout_s
        while (self.buffered or self.pending.params or self.pending.artifacts) and time.monotonic() < deadline:
            if not self.flush():
                break
        done = not (self.buffered or self.pending.params or self.pending.artifacts)
        if status is not None and self.run_id is not None:
            try:
                self.client.set_terminated(self.run_id, status)
            except Exception as err:  # noqa: BLE001 - the server went away: the metrics matter more
                self.last_error = scrub(str(err).splitlines()[0])[:200]
                return False
        return done
