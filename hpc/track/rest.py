"""The few MLflow calls a watch tick makes, over MLflow's REST API.

Why not MlflowClient: `import mlflow` costs a second of CPU (it pulls in pandas, the GenAI
stack and FastAPI), and a scheduled tick is a fresh process with a 2 s budget on the login
node. The calls below are MLflow's stable REST API 2.0, named and shaped as MlflowClient's
methods and entities (run.info.run_id, run.data.tags, ...), so the code that uses them takes
either client. `tracking_client` hands out this one for an http(s) tracking server and
MlflowClient for anything else (a local file or SQLite store, Databricks).

The credentials are MLflow's own environment variables (MLFLOW_TRACKING_TOKEN, or
MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD; MLFLOW_TRACKING_INSECURE_TLS,
MLFLOW_TRACKING_SERVER_CERT_PATH and MLFLOW_TRACKING_CLIENT_CERT_PATH for TLS). They travel in
headers only and appear in no message.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, urlparse

import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from hpc.config.secrets import tracking_auth_header
from hpc.errors import UserError

MISSING = ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE")  # no such model, alias or experiment
PAGE = 1000


class RestError(Exception):
    """The tracking server answered with an error: its error_code as MlflowException has it."""

    def __init__(self, error_code: str, message: str):
        super().__init__(message)
        self.error_code = error_code


def not_found(err: Exception) -> bool:
    """Whether a client's error (this one's or MlflowException) says the thing asked for is not there."""
    return getattr(err, "error_code", None) in MISSING


@dataclass
class RunInfo:
    run_id: str
    experiment_id: str
    run_name: str
    status: str
    start_time: int | None
    end_time: int | None
    artifact_uri: str


@dataclass
class RunData:
    metrics: dict[str, float] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)


@dataclass
class Run:
    info: RunInfo
    data: RunData


@dataclass(frozen=True)
class Metric:
    key: str
    value: float
    timestamp: int
    step: int


@dataclass(frozen=True)
class ModelVersion:
    name: str
    version: str
    run_id: str
    tags: dict[str, str]
    aliases: list[str]


@dataclass(frozen=True)
class Experiment:
    experiment_id: str
    name: str


def _pairs(items) -> dict[str, str]:
    return {p["key"]: p.get("value", "") for p in items or []}


def _run(js: dict) -> Run:
    i, d = js["info"], js.get("data", {})
    info = RunInfo(i["run_id"], i["experiment_id"], i.get("run_name", ""), i.get("status", ""),
                   int(i["start_time"]) if i.get("start_time") else None,
                   int(i["end_time"]) if i.get("end_time") else None, i.get("artifact_uri", ""))
    metrics = {m["key"]: float(m["value"]) for m in d.get("metrics", [])}
    return Run(info, RunData(metrics, _pairs(d.get("params")), _pairs(d.get("tags"))))


def _session() -> requests.Session:
    s = requests.Session()
    # Connection drops and a restarting server (502-504) are retried, as MlflowClient does; other
    # errors are answers and go to the caller.
    retry = Retry(total=3, backoff_factor=0.5, status_forcelist=(502, 503, 504),
                  allowed_methods=frozenset({"GET", "POST", "PUT"}))
    s.mount("http://", HTTPAdapter(max_retries=retry))
    s.mount("https://", HTTPAdapter(max_retries=retry))
    env = os.environ
    if header := tracking_auth_header(env):
        s.headers["Authorization"] = header
    if env.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() == "true":
        s.verify = False
    elif env.get("MLFLOW_TRACKING_SERVER_CERT_PATH"):
        s.verify = env["MLFLOW_TRACKING_SERVER_CERT_PATH"]
    if env.get("MLFLOW_TRACKING_CLIENT_CERT_PATH"):
        s.cert = env["MLFLOW_TRACKING_CLIENT_CERT_PATH"]
    return s


class RestClient:
    """The subset of MlflowClient that a watch tick and a schedule's tick use."""

    def __init__(self, uri: str, timeout_s: float = 30.0):
        self.uri = uri.rstrip("/")
        self.timeout_s = timeout_s
        self._session = _session()
        self._artifact_uri: dict[str, str] = {}

    def _call(self, method: str, endpoint: str, *, params=None, json=None, data=None, api="mlflow") -> dict:
        url = f"{self.uri}/api/2.0/{api}/{endpoint}"
        try:
            r = self._session.request(method, url, params=params, json=json, data=data, timeout=self.timeout_s)
        except requests.RequestException as err:
            raise UserError(f"tracking.uri = {self.uri}: the tracking server did not answer {endpoint} "
                            f"({type(err).__name__}); start it (`dspark mlflow`) or fix tracking.uri") from None
        try:
            body = r.json() if r.content else {}
        except ValueError:
            body = {}
        if r.status_code >= 400:
            if r.status_code in (401, 403):
                raise UserError(f"tracking.uri = {self.uri}: {endpoint} answered {r.status_code}; set "
                                "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) "
                                "for an account that may read and write this experiment")
            raise RestError(str(body.get("error_code", r.status_code)),
                            f"{endpoint}: {body.get('message') or r.reason} ({r.status_code})")
        return body

    def _paged(self, method: str, endpoint: str, key: str, limit: int, **req) -> list[dict]:
        out: list[dict] = []
        token = None
        while len(out) < limit:
            if method == "GET":
                req["params"] = {**req.get("params", {}), "max_results": min(PAGE, limit - len(out)),
                                 **({"page_token": token} if token else {})}
            else:
                req["json"] = {**req.get("json", {}), "max_results": min(PAGE, limit - len(out)),
                               **({"page_token": token} if token else {})}
            body = self._call(method, endpoint, **req)
            out += body.get(key, [])
            token = body.get("next_page_token")
            if not token:
                break
        return out

    # -- runs and experiments ---------------------------------------------------------------

    def get_experiment_by_name(self, name: str) -> Experiment | None:
        try:
            e = self._call("GET", "experiments/get-by-name", params={"experiment_name": name})["experiment"]
        except RestError as err:
            if not_found(err):
                return None
            raise
        return Experiment(e["experiment_id"], e["name"])

    def get_run(self, run_id: str) -> Run:
        run = _run(self._call("GET", "runs/get", params={"run_id": run_id})["run"])
        self._artifact_uri[run_id] = run.info.artifact_uri
        return run

    def search_runs(self, experiment_ids: list[str], filter_string: str = "", max_results: int = 1000,
                    order_by: list[str] | None = None) -> list[Run]:
        found = self._paged("POST", "runs/search", "runs", max_results,
                            json={"experiment_ids": list(experiment_ids), "filter": filter_string,
                                  "order_by": list(order_by or [])})
        return [_run(r) for r in found]

    def create_run(self, experiment_id: str, start_time: int | None = None, tags: dict[str, str] | None = None,
                   run_name: str | None = None) -> Run:
        body = {"experiment_id": experiment_id, "start_time": start_time or int(time.time() * 1000),
                "tags": [{"key": k, "value": str(v)} for k, v in (tags or {}).items()]}
        if run_name:
            body["run_name"] = run_name
        run = _run(self._call("POST", "runs/create", json=body)["run"])
        self._artifact_uri[run.info.run_id] = run.info.artifact_uri
        return run

    def log_param(self, run_id: str, key: str, value) -> None:
        self._call("POST", "runs/log-parameter", json={"run_id": run_id, "key": key, "value": str(value)})

    def log_batch(self, run_id: str, metrics=(), params=(), tags=()) -> None:
        self._call("POST", "runs/log-batch", json={
            "run_id": run_id,
            "metrics": [{"key": m.key, "value": m.value, "timestamp": m.timestamp, "step": m.step} for m in metrics],
            "params": [{"key": p.key, "value": str(p.value)} for p in params],
            "tags": [{"key": t.key, "value": str(t.value)} for t in tags]})

    def set_terminated(self, run_id: str, status: str = "FINISHED", end_time: int | None = None) -> None:
        self._call("POST", "runs/update", json={"run_id": run_id, "status": status,
                                                 "end_time": end_time or int(time.time() * 1000)})

    def get_metric_history(self, run_id: str, key: str) -> list[Metric]:
        found = self._paged("GET", "metrics/get-history", "metrics", 1 << 30,
                            params={"run_id": run_id, "metric_key": key})
        return [Metric(m["key"], float(m["value"]), int(m.get("timestamp", 0)), int(m.get("step", 0))) for m in found]

    def log_artifact(self, run_id: str, local_path: str, artifact_path: str | None = None) -> None:
        """Through the server's artifact proxy (`mlflow server`'s default); another artifact store
        (S3, a shared path) takes MLflow's own client, loaded for it alone."""
        root = self._artifact_uri.get(run_id) or self.get_run(run_id).info.artifact_uri
        u = urlparse(root)
        if u.scheme != "mlflow-artifacts":
            from mlflow.tracking import MlflowClient  # mlflow: loaded only on this path

            MlflowClient(self.uri).log_artifact(run_id, local_path, artifact_path)
            return
        base = f"{urlparse(self.uri).scheme}://{u.netloc}" if u.netloc else self.uri
        rel = "/".join(p for p in (u.path.strip("/"), (artifact_path or "").strip("/"), Path(local_path).name) if p)
        url = f"{base}/api/2.0/mlflow-artifacts/artifacts/{quote(rel)}"
        with open(local_path, "rb") as f:
            try:
                r = self._session.put(url, data=f, timeout=self.timeout_s)
            except requests.RequestException as err:
                raise UserError(f"tracking.uri = {self.uri}: the artifact upload did not reach the server "
                                f"({type(err).__name__}); start it or fix tracking.uri") from None
        if r.status_code >= 400:
            raise RestError(str(r.status_code), f"artifact upload of {rel}: {r.reason} ({r.status_code})")

    # -- the registry ----------------------------------------------------------------------

    def get_model_version_by_alias(self, name: str, alias: str) -> ModelVersion:
        mv = self._call("GET", "registered-models/alias", params={"name": name, "alias": alias})["model_version"]
        return ModelVersion(mv["name"], str(mv["version"]), mv.get("run_id", ""), _pairs(mv.get("tags")),
                            list(mv.get("aliases", [])))


def tracking_client(uri: str):
    """RestClient for an http(s) tracking server, MlflowClient for any other store."""
    if urlparse(uri).scheme in ("http", "https"):
        return RestClient(uri)
    from mlflow.tracking import MlflowClient  # mlflow: loaded only on this path

    return MlflowClient(uri)
