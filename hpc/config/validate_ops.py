"""Login-node checks of the operational sections: tracking, scheduled retraining, the planner."""

from __future__ import annotations

import base64
import os
import re
import sys
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import unquote, urlencode, urlsplit, urlunsplit

from hpc.config.checker import Checker
from hpc.config.schema import DSparkConfig
from hpc.config.secrets import flag_name, names_flag, tracking_auth_header
from hpc.config.target import is_local
from hpc.fsio import unsafe_ancestor

TRACKING_SCHEMES = ("sqlite", "http", "https", "file", "postgresql", "mysql", "databricks")
REGISTERED_MODEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._ -]*")


_PLAN_POSITIVE = {
    "target_params_b": "total target parameters in billions, e.g. 1000 for Kimi-K2.6",
    "target_active_params_b": "parameters active per token in billions, e.g. 32 for Kimi-K2.6",
    "target_bytes_per_param": "bytes per stored target parameter, e.g. 2 for bf16",
    "gpu_tflops": "dense bf16 TFLOP/s per GPU, e.g. 989 for H200",
    "link_gbps": "verifier node network bandwidth in gigabit/s, e.g. 400 for one NDR port",
    "gpu_memory_gb": "memory per GPU in GB, e.g. 141 for H200",
}


def check_plan(c: Checker, cfg: DSparkConfig) -> None:
    """The planner's knobs: zeros here become divisors in `dspark plan`."""
    p = cfg.plan
    for key, hint in _PLAN_POSITIVE.items():
        c.positive(f"plan.{key}", getattr(p, key), f"set the {hint}")
    for key in ("prefill_tok_s_per_node", "trainer_step_samples_s_per_gpu", "avg_seq_len", "source_rows",
                "regen_tokens_per_row", "regen_tok_s_per_server", "decode_tok_s_per_stream", "target_load_s",
                "fs_gbytes_s"):
        if getattr(p, key) is not None:
            c.positive(f"plan.{key}", getattr(p, key), "or null to estimate it")
    if p.timeslice_slowdown is not None and not 0 <= p.timeslice_slowdown < 1:
        c.fail("plan.timeslice_slowdown", p.timeslice_slowdown, "must be in [0, 1), the share of prefill lost, "
               "e.g. 0.05; or null to assume none")
    if not 0 < p.mfu <= 1:
        c.fail("plan.mfu", p.mfu, "must be in (0, 1], the share of peak FLOPs achieved, e.g. 0.35")
    if p.target_active_params_b > p.target_params_b:
        c.fail("plan.target_active_params_b", p.target_active_params_b,
               f"exceeds plan.target_params_b={p.target_params_b}; active params are a subset")
    if p.avg_seq_len is not None and p.avg_seq_len > cfg.data.max_seq_len:
        c.fail("plan.avg_seq_len", p.avg_seq_len, f"exceeds data.max_seq_len={cfg.data.max_seq_len}; lower it")
    if cfg.cluster.gpus_per_node == 0 and p.prefill_tok_s_per_node is None:
        c.fail("plan.prefill_tok_s_per_node", None, "estimated from cluster.gpus_per_node, which is 0; "
               "give the verifier node's measured prefill tokens/s")


HOST_REFUSED = "Invalid Host header"  # MLflow's 403 body when the Host header is not on its allow-list


def _tracking_problem(uri: str, experiment: str) -> str | None:
    """What is wrong with the MLflow server at `uri`, with the fix, or None: one authenticated
    API call, as every job will make (a TCP connect or /health passes where the API refuses: /health
    is exempt from both auth and MLflow's Host check). Credentials: the URI's `user:pw@`, else
    MLflow's variables (MLFLOW_TRACKING_TOKEN, or _USERNAME and _PASSWORD)."""
    parts = urlsplit(uri)
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    query = urlencode({"experiment_name": experiment or "Default"})
    api = parts.path.rstrip("/") + "/api/2.0/mlflow/experiments/get-by-name"
    request = urllib.request.Request(urlunsplit((parts.scheme, netloc, api, query, "")))
    if parts.username is not None:  # urllib would read `user:pw@host` as the host name
        token = base64.b64encode(f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    elif header := tracking_auth_header():
        request.add_header("Authorization", header)
    try:
        with urllib.request.urlopen(request, timeout=5):
            return None
    except urllib.error.HTTPError as err:
        body = err.read(4096).decode(errors="replace")
        if err.code == 404 and "RESOURCE_DOES_NOT_EXIST" in body:
            return None  # the experiment is made by the first job: the server answered as MLflow
        if err.code == 403 and HOST_REFUSED in body:
            return (f"the server refuses the host name {host!r} (MLflow's Host-header check: it answers only the "
                    f"names it serves); dial it by its --host address, or restart it with "
                    f"`dspark tracking serve --allow-host {host}`")
        if err.code == 401:
            return ("the server asks for credentials (401); `source ROOT/credentials.env` of `dspark tracking "
                    "serve` (MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD) where you validate and submit")
        if err.code == 403:
            return ("these credentials may not read experiments (403); use the server's credentials.env or an "
                    "account with READ and EDIT on the experiment")
        return f"the MLflow API answered HTTP {err.code} ({err.reason}); is this an MLflow tracking server?"
    except (urllib.error.URLError, OSError) as err:
        return f"MLflow server unreachable ({getattr(err, 'reason', err)}); start it or fix the URI"


def _store_parent_ok(uri: str, cfg: DSparkConfig) -> bool:
    """A file-backed store may be new, but MLflow creates whatever directory its path names, so
    a typo would leave a new directory and an empty store. The directory must exist, or be one
    the pipeline writes into anyway (the default `runs/mlflow.db` sits above runs/train).
    Relative paths resolve against this directory: jobs run where `dspark submit` ran."""
    path = uri.split(":", 1)[1]
    path = path[3:] if path.startswith("///") else path[2:] if path.startswith("//") else path
    parent = Path(os.path.abspath(Path(path).expanduser().parent))
    if parent.is_dir():
        return True
    ours = (cfg.cluster.log_dir, cfg.data.output_dir, cfg.train.output_dir, cfg.eval.output_dir)
    for out in (Path(os.path.abspath(Path(o).expanduser())) for o in ours if o):
        if out == parent or parent in out.parents:
            return True
    return False


def check_tracking(c: Checker, cfg: DSparkConfig, check_tracking: bool) -> None:
    tr = cfg.tracking
    scheme = tr.uri.split(":", 1)[0] if ":" in tr.uri else ""
    parts, malformed = urlsplit("x:"), None
    try:
        parts = urlsplit(tr.uri)
        parts.port  # noqa: B018 - raises on a port that is not a number in range
    except ValueError as err:
        malformed = err
    if malformed is not None:
        c.fail("tracking.uri", tr.uri, f"not a valid URI ({malformed}); write it as http://HOST:PORT")
    elif scheme not in TRACKING_SCHEMES:
        c.fail("tracking.uri", tr.uri, "use http://HOST:PORT of an MLflow server or sqlite:///PATH")
    elif scheme in ("http", "https") and not parts.hostname:
        c.fail("tracking.uri", tr.uri, "no host; write it as http://HOST:PORT")
    elif scheme in ("sqlite", "file") and not _store_parent_ok(tr.uri, cfg):
        c.fail("tracking.uri", tr.uri, f"the directory of this store does not exist (relative to {os.getcwd()}); "
               "create it, or fix the path")
    elif scheme in ("http", "https") and check_tracking:
        if why := _tracking_problem(tr.uri, tr.experiment):
            c.fail("tracking.uri", tr.uri, why)
    if not tr.experiment:
        c.fail("tracking.experiment", tr.experiment, "set an experiment name")
    # The registry is searched with MLflow filter strings (name = '...'), which a quote would end early:
    # the upload, the promotion and warm starts would all fail hours later, inside a job.
    if not REGISTERED_MODEL.fullmatch(tr.registered_model or ""):
        c.fail("tracking.registered_model", tr.registered_model,
               "use letters, digits, '.', '_', '-' or spaces (e.g. kimi-k2.6-dspark)")


# Flags our servers set themselves (vLLM takes the last of a repeated flag, so these would undo
# the 127.0.0.1 bind or the job's own API key), or a secret vLLM prints with its arguments.
OWNED_FLAGS = {"--host": "set verifier.host instead", "--port": "set verifier.port instead",
               "--api-key": "remove it: each server gets a key of its own, which our clients send",
               "--hf-token": "set verifier.env.HF_TOKEN instead (vLLM logs its arguments)",
               "--ssl-keyfile-password": "vLLM logs its arguments, this one too; serve TLS from a proxy"}


def check_extra_args(c: Checker, extra_args: list[str]) -> None:
    for arg in extra_args:
        if (owned := names_flag(str(arg), OWNED_FLAGS)) is not None:
            said = flag_name(str(arg))
            why = OWNED_FLAGS[owned] if said == owned else \
                f"vLLM's parser reads it as {owned} (an abbreviation); {OWNED_FLAGS[owned]}"
            c.fail("verifier.extra_args", said, why)


def warn_advisories(cfg: DSparkConfig) -> None:
    """Print `advisories` as `warning:` lines on stderr (login node: validate, submit)."""
    for line in advisories(cfg):
        print(f"warning: {line}", file=sys.stderr)


def advisories(cfg: DSparkConfig) -> list[str]:
    """What is valid but worth a second look, said on the login node."""
    v, out = cfg.verifier, []
    if v.trust_remote_code and v.revision is None and not is_local(v.model):
        out.append(f"verifier.revision is unset with verifier.trust_remote_code=true: the code on {v.model}'s "
                   "main branch when the job starts runs on every node; pin a commit (verifier.revision=SHA)")
    for i, d in enumerate(cfg.eval.compare):
        if d.model and d.revision is None and not is_local(d.model):
            out.append(f"eval.compare[{i}].revision is unset: {d.name} is loaded from {d.model}'s main branch as it "
                       f"is when each evaluation starts; pin a commit (eval.compare[{i}].revision=SHA)")
    return out


def check_paths(c: Checker, cfg: DSparkConfig) -> None:
    """An empty path means this directory, silently: captures of ~1 GB each on the shared
    filesystem instead of /dev/shm, or outputs mixed into the checkout. And every directory on the
    way to each must be root's or ours, and written by others only with the sticky bit."""
    for key, path in (("cluster.log_dir", cfg.cluster.log_dir), ("data.output_dir", cfg.data.output_dir),
                      ("train.output_dir", cfg.train.output_dir), ("eval.output_dir", cfg.eval.output_dir),
                      ("verifier.capture_dir", cfg.verifier.capture_dir)):
        if not str(path).strip():
            c.fail(key, path, "empty; name a directory")
        elif (why := unsafe_ancestor(Path(path).expanduser())) is not None:
            # On the login node, before anything is written: another user who can swap a directory on
            # the way could read the captures or plant the checkpoints, configs and markers jobs trust.
            c.fail(key, path, f"{why}; use a directory of your own (the sticky bit makes a shared one safe)")
