"""`dspark status [PIPELINE]` and `dspark cancel [PIPELINE]`: a submitted pipeline from a login node.

PIPELINE is what `dspark submit` printed: the pipeline.json path, its directory, a pipeline id
(or a unique prefix of one) under `{log_dir}/pipelines/`, or `latest`. Status asks `sacct` once
for every job and array task, adds the trainers' progress.json and the MLflow link; cancel
runs one `scancel` over every job of the pipeline.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from hpc.config.secrets import redact_uri, scrub, without_credentials
from hpc.errors import UserError
from hpc.formats import draft_failure
from hpc.fsio import read_trusted, untrusted
from hpc.launch.slurm import cancel as scancel
from hpc.launch.slurm import run_slurm
from hpc.launch.stage_table import NAMES, stage_of
from hpc.own_env import NCCL_TRACE_PREFIX
from hpc.tables import text_table
from hpc.track.pipeline import end_pipeline_run

DEFAULT_LOG_DIR = "runs/slurm"
SACCT_FIELDS = "JobID,JobName,State,Elapsed,ExitCode,NodeList"
TIMEOUT_S = 30.0
STALE_S = 60.0  # progress.json is rewritten every ~2 s: older than this, say how old
# What sacct reports for a job that will not run again (a requeued job reads PENDING/REQUEUED).
ENDED = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED",
                   "BOOT_FAIL", "DEADLINE", "REVOKED"})
# Summary order: what is done, what is moving, what waits, then the ways a job ends badly.
STATE_ORDER = ("completed", "running", "pending", "requeued", "suspended", "failed", "timeout",
               "out_of_memory", "node_fail", "preempted", "cancelled", "unknown")
# A pending array's not-yet-split tasks, as sacct prints them: 12_[0-3], 12_[0,2-5%2].
_PENDING_ARRAY = re.compile(r"^(\d+)_\[([^\]]+)\]$")
# What a failed MLflow request was, in a few words; its own message is a paragraph of urllib3.
_NET_REASONS = ("connection refused", "timed out", "name or service not known",
                "temporary failure in name resolution", "no route to host")


@dataclass(frozen=True)
class JobState:
    id: str  # "12", "12_0"; a pending range expand_array_id does not understand stays as sacct wrote it
    name: str
    state: str  # first word only: "CANCELLED by 0" -> CANCELLED
    elapsed: str
    exit_code: str
    nodes: str


# ---- finding the state file ----------------------------------------------------------------


def find_pipeline(arg: str, log_dir: str = DEFAULT_LOG_DIR) -> Path:
    """The pipeline.json that `arg` names: a path to it or its directory, an id, or `latest`."""
    path = Path(arg)
    if path.is_file():
        return path
    if (path / "pipeline.json").is_file():
        return path / "pipeline.json"
    root = Path(log_dir) / "pipelines"
    how = (f"pass a pipeline id (`ls {root}`), its directory or its pipeline.json, or `latest`; "
           "--log-dir must match the config's cluster.log_dir")
    found = sorted(root.glob("*/pipeline.json")) if root.is_dir() else []
    if arg == "latest":
        # Only the user's own: in a shared log_dir another user's file (a future `submitted` date,
        # a tracking_uri of theirs) would win, and status would send it the user's MLflow password.
        found = [f for f in found if untrusted(f) is None]
        if not found:
            raise UserError(f"no pipeline of yours under {root}: submit one with `dspark submit CONFIG`, "
                            "or pass --log-dir (the config's cluster.log_dir)")
        return max(found, key=_submitted_key)
    if (root / arg / "pipeline.json").is_file():
        return root / arg / "pipeline.json"
    if (root / arg).is_dir():
        raise UserError(f"{root / arg} has no pipeline.json: its submission failed or is still going "
                        "(`dspark submit` writes it last); check `squeue --me`")
    matches = [f for f in found if f.parent.name.startswith(arg)]
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        names = ", ".join(m.parent.name for m in matches[:4])
        raise UserError(f"{arg!r} matches {len(matches)} pipelines ({names}{', ...' if len(matches) > 4 else ''}); "
                        "give more of the id")
    raise UserError(f"no pipeline {arg!r} under {root}: {how}")


def _submitted_key(state_file: Path) -> tuple[str, float]:
    # `submitted` is ISO local time, so it sorts as text; mtime breaks ties and covers bad files.
    try:
        submitted = str(json.loads(state_file.read_text()).get("submitted", ""))
    except (OSError, ValueError, AttributeError):
        submitted = ""
    return submitted, state_file.stat().st_mtime


def load_pipeline(state_file: Path) -> dict:
    """The pipeline's state, from a file of this user's only: status and cancel act on its job ids
    and send the user's MLflow credentials to its tracking_uri."""
    try:
        state = json.loads(read_trusted(state_file))
    except PermissionError as err:
        raise UserError(f"{state_file}: refusing to trust it ({err}); pass a pipeline you submitted") from None
    except (OSError, ValueError) as err:
        raise UserError(f"{state_file}: cannot read it as a pipeline state file ({err}); "
                        "pass the pipeline.json `dspark submit` wrote") from None
    if not isinstance(state, dict) or not isinstance(state.get("jobs"), dict):
        raise UserError(f"{state_file}: not a pipeline state file (no 'jobs' map); "
                        "pass the pipeline.json `dspark submit` wrote")
    return state


# ---- sacct ---------------------------------------------------------------------------------


def job_states(job_ids: list[str]) -> dict[str, JobState]:
    """Every job and array task of `job_ids` that accounting knows, by id ("12", "12_0")."""
    ids = [str(j) for j in job_ids]
    if not ids:
        return {}
    by_hand = f"squeue -j {','.join(ids)} shows the queued and running ones"
    argv = ["sacct", "-X", "-n", "-P", "-j", ",".join(ids), "-o", SACCT_FIELDS]
    res = run_slurm(argv, timeout=TIMEOUT_S,
                    missing=f"sacct not found: run dspark status on a Slurm login node ({by_hand})",
                    no_answer=f"sacct did not answer within {{timeout}} s: is slurmdbd up? ({by_hand})",
                    failed=f"sacct failed: {{why}}; dspark status needs job accounting (slurmdbd) enabled, "
                           f"otherwise {by_hand}")
    states: dict[str, JobState] = {}
    for line in res.stdout.splitlines():
        for job in parse_sacct_line(line):
            states[job.id] = job
    return states


def parse_sacct_line(line: str) -> list[JobState]:
    """One `sacct -P` row; a pending array range becomes one JobState per task."""
    fields = line.strip().split("|")
    if len(fields) < 6 or not fields[0]:
        return []
    # A '|' in a job name would shift fields: take the fixed ones from both ends.
    jid, name = fields[0], "|".join(fields[1:-4])
    state, elapsed, exit_code, nodes = fields[-4:]
    state = (state.split() or ["UNKNOWN"])[0]
    return [JobState(t, name, state, elapsed, exit_code, nodes) for t in expand_array_id(jid)]


def expand_array_id(jid: str) -> list[str]:
    """"12_[0-2,5%2]" -> ["12_0", "12_1", "12_2", "12_5"]; anything else as it is."""
    m = _PENDING_ARRAY.match(jid)
    if not m:
        return [jid]
    tasks: list[str] = []
    try:
        for part in m.group(2).split("%")[0].split(","):  # %N is the throttle, not a task
            lo, _, rest = part.partition("-")
            hi, _, step = rest.partition(":")
            tasks += [f"{m.group(1)}_{i}" for i in range(int(lo), int(hi or lo) + 1, int(step or 1))]
    except ValueError:
        return [jid]
    return tasks


# ---- rendering -----------------------------------------------------------------------------


def _duration(seconds: float) -> str:
    s = max(int(seconds), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _train_dir_candidates(train_dir: str, state_file: Path) -> list[Path]:
    # Relative train dirs are relative to where `dspark submit` ran, which holds log_dir; from
    # elsewhere, the state file's ancestors are the places that can be.
    path = Path(train_dir)
    bases = [] if path.is_absolute() else [Path.cwd(), *Path(state_file).resolve().parents]
    return [b / path for b in bases] or [path]


def _find_train_dir(train_dir: str, state_file: Path) -> Path | None:
    return next((c for c in _train_dir_candidates(train_dir, state_file) if (c / "progress.json").is_file()), None)


def flight_dumps(train_dir: str, state_file: Path) -> list[Path]:
    """The NCCL flight recorder's dumps of a training task (hpc.dist.planes.flight_recorder_env):
    written when a data-plane op timed out, they name each rank's last collectives."""
    for c in _train_dir_candidates(train_dir, state_file):
        found = sorted((c / "logs").glob(f"{NCCL_TRACE_PREFIX}*"))
        if found:
            return found
    return []


def progress_text(train_dir: str, state_file: Path, now: float | None = None) -> str:
    """`step/total loss L N samples/s ETA T` from a trainer's progress.json; "" before it exists."""
    found = _find_train_dir(train_dir, state_file)
    if found is None:
        return ""
    try:
        p = json.loads((found / "progress.json").read_text())
        text = f"{int(p['step'])}/{int(p['total'])} loss {float(p['loss']):.3f}"
    except (OSError, ValueError, KeyError, TypeError):
        return "progress.json unreadable"
    if p.get("samples_per_s") is not None:
        text += f" {float(p['samples_per_s']):.1f} samples/s"
    if p.get("eta_s") is not None:
        text += f" ETA {_duration(float(p['eta_s']))}"
    age = (time.time() if now is None else now) - float(p.get("updated", 0) or 0)
    if age > STALE_S:
        text += f" (updated {_duration(age)} ago)"
    return text


def _draft_failure(train_dirs: list[str], i: int, state_file: Path) -> dict | None:
    """Why draft i of a shared verifier's job failed alone (hpc.formats.draft_failure), if it did."""
    candidates = _train_dir_candidates(train_dirs[i], state_file) if i < len(train_dirs) else []
    return next((f for f in map(draft_failure.read, candidates) if f is not None), None)


def _rows(state: dict, jobs: dict[str, JobState], state_file: Path) -> list[tuple[str, ...]]:
    train_dirs = list(state.get("train_dirs") or [])
    labels = list(state.get("labels") or [])  # a state file from before names lists none
    rows: list[tuple[str, ...]] = []
    # In the table's order (a state file written by an older submit may list them otherwise).
    rank = {name: i for i, name in enumerate(NAMES)}
    order = sorted(state["jobs"].items(), key=lambda kv: rank.get(stage_of(kv[0]), len(NAMES)))
    for stage, jid in order:
        jid = str(jid)
        mine = [j for k, j in jobs.items() if k == jid or k.startswith(f"{jid}_")]
        mine.sort(key=lambda j: (len(j.id), j.id))  # 12_2 before 12_10
        if not mine:
            rows.append((stage, jid, "-", "UNKNOWN", "-", "-", "-", "not in sacct yet"))
            continue
        shared = stage_of(stage) == "train" and bool(state.get("shared_verifier")) and len(mine) == 1
        # a shared verifier's one train job trains every variant: a row for each, its progress
        tasks = [(mine[0], str(i)) for i in range(len(train_dirs))] if shared else [
            (j, j.id.partition("_")[2]) for j in mine]
        for j, task in tasks:
            variant = f"v{task}" if task.isdigit() else (task or "-")
            if task.isdigit() and int(task) < len(labels) and labels[int(task)]:
                variant += f" {labels[int(task)]}"  # its name on the card: DFlash, lr=0.001
            progress = ""
            if stage_of(stage) == "train":
                i = int(task) if task.isdigit() else 0
                progress = progress_text(train_dirs[i], state_file) if i < len(train_dirs) else ""
                dumps = flight_dumps(train_dirs[i], state_file) if i < len(train_dirs) else []
                if dumps:  # an NCCL op timed out: where each rank's last collectives are
                    progress = (progress + "; " if progress else "") + (
                        f"NCCL timeout: flight recorder dumps {dumps[0].parent}/{NCCL_TRACE_PREFIX}* ({len(dumps)} ranks)")
            nodes = "-" if j.nodes.startswith("None") or not j.nodes else j.nodes
            job_state = j.state
            failed = _draft_failure(train_dirs, int(task), state_file) if shared and task.isdigit() else None
            if failed is not None:  # this draft failed alone; the job trained the others on
                job_state, progress = "FAILED", f"this draft failed: {failed['cause']}"
            rows.append((stage, j.id, variant, job_state, j.elapsed, j.exit_code, nodes, progress))
    return rows


def _fail_fast() -> None:
    """MLflow's defaults retry for minutes; status and cancel have to come back in seconds."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")


def mlflow_link(state: dict) -> str:
    """Where the pipeline's parent run is; never fails, since a dead server must not hide the table."""
    uri, run = str(state.get("tracking_uri") or ""), state.get("parent_run_id") or "?"
    if uri.startswith("sqlite:"):
        return f"mlflow: run {run}; browse with `mlflow ui --backend-store-uri {uri}`"
    if not uri.startswith(("http://", "https://")):
        return f"mlflow: run {run} at {redact_uri(uri) if uri else '(no tracking uri)'}"
    _fail_fast()
    try:
        from mlflow.tracking import MlflowClient  # mlflow: seconds to import, only for the link

        exp = MlflowClient(uri).get_experiment_by_name(str(state.get("experiment")))
    except Exception as err:  # noqa: BLE001 - any failure only costs the link
        text = str(err).lower()
        why = next((r for r in _NET_REASONS if r in text), type(err).__name__)
        return f"mlflow: run {run} at {redact_uri(uri)} (could not look up the experiment: {why})"
    if exp is None:
        return f"mlflow: run {run} at {redact_uri(uri)} (no experiment {state.get('experiment')!r} there)"
    # A link to click: the browser asks for the login, so the URI's credentials are left out.
    return f"mlflow: {without_credentials(uri).rstrip('/')}/#/experiments/{exp.experiment_id}/runs/{run}"


def summary(rows: list[tuple[str, ...]]) -> str:
    counts = Counter(r[3].lower() for r in rows)
    order = [s for s in STATE_ORDER if s in counts] + sorted(set(counts) - set(STATE_ORDER))
    return ", ".join(f"{counts[s]} {s.replace('_', ' ')}" for s in order)


def status(pipeline_file: Path | str) -> str:
    """The status report: one row per job or array task, the MLflow link, a summary line."""
    return report(pipeline_file)[0]


def report(pipeline_file: Path | str) -> tuple[str, list[tuple[str, ...]]]:
    """The status report and its rows (stage, job, variant, state, ...)."""
    state_file = Path(pipeline_file)
    state = load_pipeline(state_file)
    rows = _rows(state, job_states([str(j) for j in state["jobs"].values()]), state_file)
    head = (f"pipeline {state.get('pipeline', state_file.parent.name)} "
            f"(submitted {state.get('submitted', '?')}, config {state.get('config', '?')})")
    # Never fitted to the terminal: at 80 columns rich cut job ids and states and dropped the
    # progress column. A long row runs past the edge (or wraps) whole.
    table = text_table(["stage", "job", "variant", "state", "elapsed", "exit", "nodes", "progress"], rows)
    lines = [head, *table, mlflow_link(state), summary(rows)]
    return "\n".join(lines) + "\n", rows


def finished(rows: list[tuple[str, ...]]) -> bool:
    """Every job and array task has ended (a requeued or not-yet-listed one has not)."""
    return bool(rows) and all(r[3].upper() in ENDED for r in rows)


def wait(pipeline_file: Path | str, interval_s: float = 15.0, out=print) -> int:
    """Block until every job of the pipeline has ended, a line each time the summary changes;
    then the full report. 0 when every job COMPLETED, else 1."""
    last = ""
    while True:
        text, rows = report(pipeline_file)
        if finished(rows):
            break
        line = summary(rows)
        if line != last:
            out(f"{time.strftime('%H:%M:%S')}  {line}", flush=True)
            last = line
        time.sleep(interval_s)
    out(text, end="", flush=True)
    bad = [f"{r[0]} {r[1]} {r[3]}" for r in rows if r[3].upper() != "COMPLETED"]
    if bad:
        out(f"not every job completed: {', '.join(bad)}; their logs are under the config's cluster.log_dir",
            flush=True)
    return 1 if bad else 0


def cancel(pipeline_file: Path | str) -> list[str]:
    """scancel every job of the pipeline at once; jobs that already ended are left as they are."""
    state_file = Path(pipeline_file)
    state = load_pipeline(state_file)
    ids = [str(j) for j in state["jobs"].values()]
    scancel(ids)  # raises a UserError naming the ids to cancel by hand when scancel is missing
    name = state.get("pipeline", state_file.parent.name)
    print(f"cancelled pipeline {name}: " + ", ".join(f"{k} {v}" for k, v in state["jobs"].items())
          + " (jobs that had already ended are unchanged)")
    _end_cancelled(state)
    return ids


def _end_cancelled(state: dict) -> None:
    """The report job, which ends the pipeline's MLflow run, is cancelled too: end a run still
    RUNNING as KILLED. One that already ended keeps its outcome; a tracking outage costs a line."""
    uri, run_id = str(state.get("tracking_uri") or ""), state.get("parent_run_id")
    if not run_id or not uri or (uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file()):
        return
    _fail_fast()
    try:
        from mlflow.tracking import MlflowClient  # mlflow: loaded only on this path

        client = MlflowClient(uri)
        if client.get_run(run_id).info.status != "RUNNING":
            return
    except Exception as err:  # noqa: BLE001 - the jobs are cancelled; the run is a record of it
        print(f"warning: pipeline run {run_id} not marked KILLED: {scrub(str(err).splitlines()[0])[:160]}", flush=True)
        return

    end_pipeline_run(client, run_id, "KILLED", "cancelled with `dspark cancel`")


# ---- CLI -----------------------------------------------------------------------------------


def _status_cmd(args) -> int:
    pipeline = find_pipeline(args.pipeline, args.log_dir)
    if getattr(args, "wait", False):
        if not args.interval > 0:
            raise UserError(f"--interval {args.interval:g}: give the seconds between sacct calls, > 0")
        return wait(pipeline, args.interval)
    print(status(pipeline), end="")
    return 0


def _cancel_cmd(args) -> int:
    cancel(find_pipeline(args.pipeline, args.log_dir))
    return 0


def _register(sub, name: str) -> None:
    p = sub.add_parser(name, description=__doc__)
    p.add_argument("pipeline", nargs="?", default="latest",
                   help="pipeline.json, its directory, a pipeline id, or latest (the default)")
    p.add_argument("--log-dir", default=DEFAULT_LOG_DIR,
                   help=f"the config's cluster.log_dir (default {DEFAULT_LOG_DIR})")
    if name == "status":
        p.add_argument("--wait", action="store_true",
                       help="block until every job has ended, a line per change; exit 1 unless all COMPLETED")
        p.add_argument("--interval", type=float, default=15.0, help="seconds between sacct calls with --wait")
    p.set_defaults(func=_status_cmd if name == "status" else _cancel_cmd)


def register_status(sub) -> None:
    _register(sub, "status")


def register_cancel(sub) -> None:
    _register(sub, "cancel")
