"""Login-node checks of what a pipeline will ask Slurm for, before anything is submitted.

`dspark submit` submits several dependent jobs; a request Slurm rejects (unknown partition,
too many nodes, a time over the partition's MaxTime, an unknown account) would otherwise
surface only after the first jobs are queued. `check_requests` asks `sinfo` and `sacctmgr`
up front and returns every problem at once, one line each, naming the config key to change.
`cancel` undoes a submission that failed midway so nothing is left half-submitted.

`run_slurm` is the one way this package runs a Slurm client (sbatch, squeue, sacct, scancel,
scontrol, sinfo, sacctmgr, scrontab): a missing program, no answer or a refusal is one UserError.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, replace

from hpc.config.schema import DSparkConfig
from hpc.config.shared_sweep import shared_groups, train_nodes
from hpc.errors import UserError
from hpc.formats.slurm_time import TIME_FIX, parse_slurm_time

SINFO_MISSING = ("sinfo not found: run dspark submit on a Slurm login node "
                 "(or `dspark-dev devcluster up` for the local test cluster)")
TIMEOUT_S = 30.0
# The keys that set each stage's node count, for messages; train spans two roles.
NODE_KEYS = {
    "regenerate": ("cluster.regenerate_nodes",),
    "train": ("cluster.verifier_nodes", "cluster.trainer_nodes"),
    "eval": ("cluster.eval_nodes",),
}
# scancel complaints that mean the job is already gone, which is what cancel() wants anyway.
_ALREADY_GONE = re.compile(r"already completing or completed|invalid job id", re.I)


@dataclass(frozen=True)
class JobRequest:
    """One kind of job a pipeline submits, as sbatch will see it."""

    stage: str
    partition: str
    nodes: int
    time: str
    account: str | None
    gpus_per_node: int
    cpus_per_task: int
    groups: int = 1  # a shared verifier's train job: `per_group` trainer nodes for each of this many variants
    per_group: int = 0


@dataclass(frozen=True)
class Partition:
    name: str
    nodes: int  # total, whatever their state
    max_time: int | None  # minutes; None is no limit
    up: bool
    default: bool


def requests_for(cfg: DSparkConfig) -> list[JobRequest]:
    """The jobs `dspark submit` queues for this config, in submission order; a shared verifier's
    train job holds a group of trainer nodes for each variant of the sweep."""
    cl = cfg.cluster
    groups = shared_groups(cfg)

    def job(stage: str, nodes: int, gpus: int, groups: int = 1) -> JobRequest:
        # The schema has one partition/time/account for every stage.
        return JobRequest(stage, cl.partition, nodes, cl.time, cl.account, gpus, cl.cpus_per_task, groups,
                          cl.trainer_nodes if groups > 1 else 0)

    reqs = []
    if cfg.data.regenerate:
        reqs.append(job("regenerate", cl.regenerate_nodes, cl.gpus_per_node))
    reqs.append(job("train", train_nodes(cfg), cl.gpus_per_node, groups))
    reqs.append(job("eval", cl.eval_nodes, cl.gpus_per_node))
    # The report only reads eval results and the tracking store: no GPU to hold idle.
    reqs.append(job("report", 1, 0))
    return reqs


def format_minutes(minutes: int) -> str:
    """Minutes as Slurm prints a limit: D-HH:MM:SS, or HH:MM:SS under a day."""
    days, rem = divmod(minutes, 24 * 60)
    hm = f"{rem // 60:02d}:{rem % 60:02d}:00"
    return f"{days}-{hm}" if days else hm


class SlurmMissing(UserError):
    """The Slurm client program is not installed here: not a Slurm node."""


def run_slurm(argv: Sequence[str], *, check: bool = True, timeout: float = TIMEOUT_S,
              missing: str = "{prog} not found: run this on a Slurm login node",
              no_answer: str = "{prog} did not answer within {timeout} s: is slurmctld up? "
                               "(check with `scontrol ping`)",
              failed: str = "{prog} failed (exit {rc}): {why}") -> subprocess.CompletedProcess[str]:
    """Run one Slurm client command, its output captured as text.

    What goes wrong is one line of UserError: `missing` (as SlurmMissing) when the program is not
    installed, `no_answer` when it does not answer within `timeout` seconds and, with `check`, `failed`
    when it exits non-zero, with {prog}, {timeout} (whole seconds), {rc} and {why} (slurm_why) filled in.
    Without `check` the caller judges the exit code and output itself.
    """
    def say(template: str, res: subprocess.CompletedProcess[str] | None = None) -> str:
        # Not str.format: the caller's own text (job ids, paths) may hold braces.
        fields = {"prog": argv[0], "timeout": f"{timeout:.0f}"}
        if res is not None:
            fields.update(rc=str(res.returncode), why=slurm_why(res))
        for key, value in fields.items():
            template = template.replace("{" + key + "}", value)
        return template

    # SINFO_PARTITION and friends from the user's shell would silently filter what we see.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SINFO_", "SACCTMGR_"))}
    try:
        res = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, env=env, check=False)
    except FileNotFoundError:
        raise SlurmMissing(say(missing)) from None
    except subprocess.TimeoutExpired:
        raise UserError(say(no_answer)) from None
    if check and res.returncode != 0:
        raise UserError(say(failed, res))
    return res


def slurm_why(res: subprocess.CompletedProcess[str]) -> str:
    """The last line a Slurm command printed, stderr first (where Slurm puts its reason), else its exit code."""
    text = (res.stderr.strip() or res.stdout.strip() or f"exit {res.returncode}").splitlines()[-1]
    return text.strip()


def _last_line(text: str) -> str:
    return (text.strip().splitlines() or ["no output"])[-1].strip()


def partitions() -> dict[str, Partition]:
    """Every partition `sinfo` knows (hidden ones too), by name; raises UserError if it can't say."""
    argv = ["sinfo", "-h", "-a", "-o", "%P|%D|%l|%a"]
    res = run_slurm(argv, missing=SINFO_MISSING,
                    failed="sinfo failed (exit {rc}): {why}; check SLURM_CONF and `scontrol ping`")
    found: dict[str, Partition] = {}
    for line in filter(str.strip, res.stdout.splitlines()):
        try:
            part = _parse_sinfo_line(line)
        except ValueError:
            raise UserError(f"sinfo output not understood: {line.strip()!r}; expected NAME|NODES|"
                            f"TIMELIMIT|AVAIL from `{' '.join(argv)}`") from None
        if (seen := found.get(part.name)) is not None:
            # sinfo may split a partition over several lines; its size is their sum.
            part = replace(seen, nodes=seen.nodes + part.nodes, default=seen.default or part.default)
        found[part.name] = part
    if not found:
        raise UserError(f"sinfo lists no partitions: {_last_line(res.stderr)}; "
                        "check SLURM_CONF points at this cluster")
    return found


def _parse_sinfo_line(line: str) -> Partition:
    fields = line.strip().split("|")
    if len(fields) != 4 or not fields[0] or not fields[1].isdigit():
        raise ValueError(line)
    name, nodes, limit, avail = fields
    default = name.endswith("*")
    return Partition(name.rstrip("*"), int(nodes), parse_slurm_time(limit),
                     avail.strip().lower() == "up", default)


def account_exists(name: str) -> bool | None:
    """Whether the accounting database knows `name`; None if there is no accounting to ask."""
    try:
        res = run_slurm(["sacctmgr", "-nP", "show", "account", name, "format=account"])
    except UserError:  # not installed, no answer, no slurmdbd, or accounting_storage/none
        return None
    # Slurm stores account names lower-cased and matches them case-insensitively.
    return name.strip().lower() in {ln.strip().lower() for ln in res.stdout.splitlines()}


def check_requests(reqs: Sequence[JobRequest]) -> list[str]:
    """Every problem Slurm would reject the requests for, one line each; [] when all fit."""
    try:
        parts = partitions()
    except UserError as err:
        return [str(err)]
    problems: list[str] = []
    for req in reqs:
        problems += _check_one(req, parts)
    for account in dict.fromkeys(r.account for r in reqs if r.account):
        # With no cluster.account Slurm picks the user's default one: nothing to check then.
        if account_exists(account) is False:
            problems.append(f"cluster.account = {account!r}: no such Slurm account; set it to one "
                            "`sacctmgr show associations user=$USER format=account` lists")
    # Stages share partition and time: report each such problem once.
    return list(dict.fromkeys(problems))


def max_array_size() -> int | None:
    """Slurm's MaxArraySize (array task ids run 0..MaxArraySize-1); None where scontrol cannot say."""
    try:
        res = run_slurm(["scontrol", "show", "config"], check=False)
    except UserError:  # no scontrol, or no answer: sinfo's own check names that
        return None
    found = re.search(r"^MaxArraySize\s*=\s*(\d+)\s*$", res.stdout, re.M) if res.returncode == 0 else None
    return int(found.group(1)) if found else None


def array_problems(tasks: int) -> list[str]:
    """A training array of `tasks` sweep variants that this cluster's MaxArraySize refuses."""
    if tasks <= 1:
        return []
    cap = max_array_size()
    if cap is None or tasks <= cap:
        return []
    return [f"sweep: {tasks} variants, but this cluster's MaxArraySize is {cap} (task ids 0..{cap - 1}); "
            f"sweep at most {cap} combinations, or submit the sweep as several pipelines"]


def _check_one(req: JobRequest, parts: dict[str, Partition]) -> list[str]:
    problems = []
    try:
        want = parse_slurm_time(req.time)
    except ValueError:
        problems.append(f"cluster.time = {req.time!r}: not a Slurm time; {TIME_FIX}")
        want = -1  # already reported
    part = parts.get(req.partition)
    if part is None:
        listed = ", ".join(sorted(parts))
        problems.append(f"cluster.partition = {req.partition!r}: no such partition; "
                        f"sinfo lists: {listed}")
        return problems
    if not part.up:
        problems.append(f"cluster.partition = {req.partition!r}: partition is not up (sinfo says "
                        "it is down, drained or inactive); choose another or ask the admins")
    if req.nodes > part.nodes:
        problems.append(_nodes_problem(req, part))
    if part.max_time is not None and want != -1 and (want is None or want == 0 or want > part.max_time):
        # 0 and UNLIMITED ask for no limit, which a partition with a MaxTime refuses just the same.
        problems.append(f"cluster.time = {req.time!r}: over partition {part.name!r}'s MaxTime "
                        f"{format_minutes(part.max_time)}; set cluster.time <= "
                        f"{format_minutes(part.max_time)}")
    return problems


def _nodes_problem(req: JobRequest, part: Partition) -> str:
    keys = NODE_KEYS.get(req.stage)
    where = f"partition {part.name!r} has {part.nodes}"
    if req.groups > 1:  # the shared verifier's allocation: V + K x T
        most = (part.nodes - (req.nodes - req.groups * req.per_group)) // max(req.per_group, 1)
        fits = f"at most {most} variants fit" if most >= 2 else "not even two variants fit"
        return (f"cluster.verifier_nodes + {req.groups} variants x cluster.trainer_nodes = {req.nodes}: the shared "
                f"verifier's train job needs {req.nodes} nodes but {where} ({fits}); sweep fewer values, lower "
                "cluster.trainer_nodes, or set submit.share_verifier=false (an allocation per variant)")
    if not keys:  # a fixed-size job (the report): only another partition helps
        return (f"cluster.partition = {req.partition!r}: the {req.stage} job needs {req.nodes} "
                f"node(s) but {where}; choose a partition with nodes")
    return (f"{' + '.join(keys)} = {req.nodes}: the {req.stage} job needs {req.nodes} nodes but "
            f"{where}; lower {' / '.join(keys)} to fit or choose a bigger cluster.partition")


def cancel(job_ids: Sequence[str]) -> None:
    """Cancel jobs in one scancel call; jobs that already ended are not an error."""
    ids = [str(j) for j in job_ids]
    if not ids:
        return
    by_hand = f"cancel them by hand: scancel {' '.join(ids)}"
    res = run_slurm(["scancel", *ids], check=False, missing=f"scancel not found; {by_hand} on a Slurm login node",
                    no_answer=f"scancel did not answer within {{timeout}} s; {by_hand}")
    if res.returncode == 0:
        return
    errors = [ln for ln in res.stderr.splitlines() if ln.strip() and not _ALREADY_GONE.search(ln)]
    if errors or not res.stderr.strip():
        last = errors[-1].strip() if errors else f"exit {res.returncode}"
        raise UserError(f"scancel failed: {last}; {by_hand}")
