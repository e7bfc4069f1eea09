"""`dspark submit CONFIG [KEY=VALUE ...] [--dry-run]`: the whole pipeline from a login node.

Nothing is submitted unless everything checks out: the config (every problem at once), the
sweep, and the Slurm requests against `sinfo`/`sacctmgr`. Then the MLflow parent run is
created and the jobs go in with submitit, wired by dependencies:

    regenerate (optional) --afterok--> train array (one task per sweep variant, V+T nodes each)
    train array --aftercorr--> calibrate array (with calibration or held-out rows)
    train + calibrate arrays --aftercorr--> eval-n3 array, eval-n7 array (task i evaluates variant i)
    eval arrays --afterany--> report (the comparison table, into the parent run)

The stages and their dependencies are declared once, in `hpc.launch.stage_table`. If a
submission fails midway, the jobs already submitted are cancelled.
"""

from __future__ import annotations

import datetime
import json
import secrets
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from hpc.config import sweep_overrides, to_yaml
from hpc.config.schema import ClusterConfig, DSparkConfig, SourceKind
from hpc.config.secrets import redact_uri, scrub
from hpc.config.shared_sweep import ONE_VARIANT, shares_verifier, train_nodes
from hpc.config.validate_ops import warn_advisories
from hpc.errors import ConfigError, UserError
from hpc.formats.slurm_time import parse_slurm_time
from hpc.fsio import write_text
from hpc.launch.launch_checks import resolve
from hpc.launch.plan import pipeline_problems
from hpc.launch.slurm import array_problems, cancel, check_requests, requests_for
from hpc.launch.stage_table import check_sweep_shape, jobs, run_stage
from hpc.launch.variants import private_dir, variant_path
from hpc.track.pipeline import create_pipeline_run, end_pipeline_run


@dataclass
class StageJobs:
    name: str  # regenerate | train | eval-n3 | eval-n7 | report
    params: dict  # submitit executor parameters
    calls: list[tuple]  # run_stage arguments, one per array task
    after: list[tuple[str, str]] = field(default_factory=list)  # (dependency type, stage name)
    array: bool = True  # a job array, one task per variant; else a single job


@dataclass
class Pipeline:
    id: str
    root: Path  # runs/pipelines/<id>: variant configs, submitit logs, the state file
    variant_files: list[Path]
    variant_overrides: list[list[str]]
    stages: list[StageJobs]
    labels: list[str] = field(default_factory=list)  # each variant's column on the card (eval.label)


def _minutes(time: str) -> int:
    minutes = parse_slurm_time(time)
    if minutes is None:
        return 60 * 24 * 365  # "infinite": submitit wants a number
    return minutes


def _base_params(c: ClusterConfig, name: str, nodes: int, gpus: bool) -> dict:
    params: dict = {"slurm_partition": c.partition, "timeout_min": _minutes(c.time), "nodes": nodes, "tasks_per_node": 1,
              "cpus_per_task": c.cpus_per_task, "name": name, "slurm_signal_delay_s": c.signal_delay_s}
    extra: dict = {"requeue": True}
    if c.account:
        params["slurm_account"] = c.account
    if c.qos:
        params["slurm_qos"] = c.qos
    if c.mem is not None and c.mem != "":
        params["slurm_mem"] = c.mem
    if c.exclusive:
        params["slurm_exclusive"] = True
    if gpus and c.gpus_per_node:
        params["slurm_gres"] = f"gpu:{c.gpus_per_node}"
    for item in c.sbatch_extra:  # "--key=value" or "--flag"
        key, _, value = item.lstrip("-").partition("=")
        extra[key.replace("-", "_")] = value if value else True
    params["slurm_additional_parameters"] = extra
    return params


def _new_pipeline_dir(parent: Path, name: str) -> tuple[Path, str]:
    """A pipeline id no other submit has, and its directory, created 0700 and exclusively: two
    submits in the same second (a script, a scheduled tick) never share one."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    parent.mkdir(parents=True, exist_ok=True)  # may be shared by a group: only our own dir is 0700
    for _ in range(100):
        pid = f"{name}-{stamp}-{secrets.token_hex(2)}"
        try:
            (parent / pid).mkdir(mode=0o700)
        except FileExistsError:
            continue
        return parent / pid, pid
    raise UserError(f"could not create a new pipeline directory under {parent}; check that it is writable")


def traffic_pins(cfg: DSparkConfig, now: float | None = None) -> list[str]:
    """Overrides fixing each traffic source's window at this submission: its stages run hours
    apart (a requeue, days), and each must read the rows the others read."""
    when = datetime.datetime.fromtimestamp(time.time() if now is None else now, datetime.UTC)
    stamp = when.strftime("%Y-%m-%dT%H:%M:%SZ")
    return [f"data.{key}.{i}.until='{stamp}'"  # quoted: YAML would read a timestamp, and print it another way
            for key in ("sources", "calibration_sources") for i, src in enumerate(getattr(cfg.data, key))
            if src.kind == SourceKind.traffic and src.until is None]


def plan_pipeline(config: str, overrides: list[str], pipeline_id: str | None = None) -> tuple[DSparkConfig, Pipeline]:
    """Validate and lay out the jobs; writes only the frozen variant configs."""
    cfg = resolve(config, overrides)  # every config problem, including the sweep's keys and tracking
    if pins := traffic_pins(cfg):
        overrides = [*overrides, *pins]
        cfg = resolve(config, overrides, check_tracking=False)

    warn_advisories(cfg)
    scheme = cfg.tracking.uri.split(":", 1)[0]
    if scheme in ("sqlite", "file") and not cfg.tracking.allow_file_store:
        raise UserError(f"tracking.uri = {cfg.tracking.uri!r}: a pipeline's jobs write to the tracking store at once, "
                        "which a SQLite or file store on a shared filesystem does not survive; run `dspark tracking "
                        "serve` and set tracking.uri to its http address (or tracking.allow_file_store=true)")
    root, pid = _new_pipeline_dir(Path(cfg.cluster.log_dir) / "pipelines", pipeline_id or cfg.name)
    variants = sweep_overrides(OmegaConf.structured(cfg))
    outs = [Path(cfg.train.output_dir) / pid / f"v{i}" for i in range(len(variants))]
    vcfgs = [resolve(config, [*overrides, *extra, f"train.output_dir={out / 'train'}",
                              f"eval.output_dir={out / 'eval'}", *ONE_VARIANT], check_tracking=False)
             for extra, out in zip(variants, outs)]
    try:
        check_sweep_shape(cfg, list(zip(variants, vcfgs)))
        # Each variant's stages must fit their Slurm time and its preemption window (as validate says).
        late = list(dict.fromkeys(line for vcfg in vcfgs for line in pipeline_problems(vcfg)))
        if late:
            raise ConfigError(late)
    except UserError:
        root.rmdir()  # nothing written into it yet
        raise
    files = []
    private_dir(Path(cfg.train.output_dir) / pid)
    for i, vcfg in enumerate(vcfgs):
        text = to_yaml(OmegaConf.structured(vcfg))
        path = variant_path(root, i, text)
        write_text(path, text, mode=0o600)
        files.append(path)

    stages = []
    for job in jobs(cfg):
        s = job.stage
        nodes = train_nodes(cfg) if job.variants > 1 else s.nodes(cfg.cluster)
        params = _base_params(cfg.cluster, f"{cfg.name}-{job.name}", nodes, s.gpus)
        if s.kill_on_bad_exit:
            params["slurm_srun_args"] = ["--kill-on-bad-exit=1"]
        per_n = (job.n,) if job.n is not None else ()
        if job.variants > 1:  # one allocation trains every variant: the others' configs ride along
            calls: list[tuple] = [(s.name, str(files[0]), None, tuple(str(f) for f in files[1:]))]
        else:
            calls = [(s.name, str(f), *per_n) for f in (files if job.array else files[:1])]
        stages.append(StageJobs(job.name, params, calls, list(job.after), array=job.array))
    return cfg, Pipeline(pid, root, files, variants, stages, [v.eval.label or "" for v in vcfgs])


def train_dirs(cfg: DSparkConfig, p: Pipeline) -> list[Path]:
    """Each variant's train.output_dir, as plan_pipeline froze it."""
    return [Path(cfg.train.output_dir) / p.id / f"v{i}" / "train" for i in range(len(p.variant_files))]


def _executor(folder: Path, params: dict, dependency: str | None, array: int):
    import submitit  # submitit: loaded only on this path

    ex = submitit.AutoExecutor(folder=str(folder / "%j"), cluster="slurm")
    p = dict(params)
    extra = dict(p.pop("slurm_additional_parameters", {}))
    if dependency:
        extra["dependency"] = dependency
        # A stage after a failed one would otherwise pend forever (Slurm's default keeps it, as
        # DependencyNeverSatisfied): the report never runs, the pipeline's MLflow run stays
        # RUNNING, and the scheduled retrain takes that for a pipeline under way.
        extra["kill-on-invalid-dep"] = "yes"
    ex.update_parameters(**p, slurm_additional_parameters=extra, slurm_array_parallelism=max(array, 1))
    return ex


def _dependency(stage: StageJobs, ids: dict[str, str]) -> str | None:
    parts: dict[str, list[str]] = {}
    for kind, name in stage.after:
        if name in ids:
            parts.setdefault(kind, []).append(ids[name])
    return ",".join(f"{kind}:{':'.join(v)}" for kind, v in parts.items()) or None


def sbatch_script(ex, n_tasks: int) -> str:
    """The script submitit would hand to sbatch (the same private hook it uses itself)."""
    inner = ex._executor
    if n_tasks > 1:
        inner.parameters["map_count"] = n_tasks
    text = inner._make_submission_file_text(inner._submitit_command_str, "dry-run")
    inner.parameters.pop("map_count", None)
    return text


def dry_run(p: Pipeline) -> int:
    fake = {s.name: f"<{s.name}>" for s in p.stages}
    print(f"pipeline {p.id}: {len(p.variant_files)} variant(s); nothing is submitted (--dry-run)\n")
    for i, extra in enumerate(p.variant_overrides):
        print(f"variant {i}: {' '.join(extra) or '(no sweep)'} -> {p.variant_files[i]}")
    print("\ndependency graph:")
    for s in p.stages:
        dep = _dependency(s, fake)
        print(f"  {s.name:<12} {len(s.calls)} task(s) x {s.params['nodes']} node(s)" + (f"  after {dep}" if dep else ""))
    for s in p.stages:
        ex = _executor(p.root / "logs", s.params, _dependency(s, fake), len(s.calls))
        print(f"\n# ---- {s.name}: sbatch script ----\n{sbatch_script(ex, len(s.calls))}")
    return 0


def _discard(cfg: DSparkConfig, p: Pipeline) -> None:
    """Remove what planning wrote: the pipeline's directory and its (still empty) output directory."""
    shutil.rmtree(p.root, ignore_errors=True)
    try:
        (Path(cfg.train.output_dir) / p.id).rmdir()
    except OSError:
        pass  # not empty: something else wrote there, keep it


def submit(config: str, overrides: list[str], dry: bool = False, extra_tags: dict[str, str] | None = None) -> int:
    """Submit the pipeline; `extra_tags` go on its MLflow parent run (`dspark schedule` marks its runs)."""
    cfg, p = plan_pipeline(config, overrides)
    try:
        problems = check_requests(requests_for(cfg)) + array_problems(len(p.variant_files))
        if problems:
            raise UserError("nothing submitted:\n" + "\n".join(problems))
        if dry:
            return dry_run(p)  # its variant files stay: the dry run names them for a look
        from mlflow.tracking import MlflowClient  # mlflow: not for a dry run

        client = MlflowClient(cfg.tracking.uri)
        parent = create_pipeline_run(client, cfg, p.id, extra_tags)
    except BaseException:
        _discard(cfg, p)  # nothing was submitted: leave no pipeline behind for `dspark status` to find
        raise

    ids: dict[str, str] = {}
    submitted: list[str] = []
    try:
        for s in p.stages:
            ex = _executor(p.root / "logs", s.params, _dependency(s, ids), len(s.calls))
            calls = [(*c[:2], parent, *c[2:]) for c in s.calls]  # (stage, file, parent[, n])
            if not s.array:
                job = ex.submit(run_stage, *calls[0])
                ids[s.name] = job.job_id
            else:
                jobs = ex.map_array(run_stage, *zip(*calls))
                ids[s.name] = jobs[0].job_id.split("_")[0]
            submitted.append(ids[s.name])
    except Exception as err:
        cancel(submitted)
        why = f"submission failed at stage {s.name} ({scrub(str(err).splitlines()[0])[:200]})"
        end_pipeline_run(client, parent, "FAILED", why)  # nothing will run to end it
        raise UserError(f"{why}; cancelled the {len(submitted)} job(s) already submitted") from err
    state = {"pipeline": p.id, "config": str(Path(config).resolve()), "overrides": overrides,
             "parent_run_id": parent, "tracking_uri": cfg.tracking.uri, "experiment": cfg.tracking.experiment,
             "jobs": ids, "variants": [str(f) for f in p.variant_files],
             "shared_verifier": shares_verifier(cfg), "labels": p.labels,
             "train_dirs": [str(d) for d in train_dirs(cfg, p)],
             "submitted": datetime.datetime.now().isoformat(timespec="seconds")}
    state_file = p.root / "pipeline.json"
    write_text(state_file, json.dumps(state, indent=1) + "\n", mode=0o600)
    print(f"pipeline {p.id}: submitted " + ", ".join(f"{k} {v}" for k, v in ids.items()))
    print(f"mlflow: {redact_uri(cfg.tracking.uri)} experiment {cfg.tracking.experiment}, parent run {parent}")
    print(f"watch:  dspark status {state_file}    (or squeue --me, sacct -j {','.join(ids.values())})")
    print(f"cancel: dspark cancel {state_file}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("submit", help="submit the whole pipeline to Slurm (regenerate, train array, evals, report)",
                       description=__doc__)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    p.add_argument("--dry-run", action="store_true", help="print every sbatch script and the graph; submit nothing")
    p.add_argument("--ablations", action="store_true",
                   help="train DSpark, DFlash and Markov-only from one verifier's stream, evaluate each, and add "
                        "the equal-budget table to the card (submit.ablations=true)")
    p.set_defaults(func=lambda a: submit(a.config, [*a.overrides, *(["submit.ablations=true"] if a.ablations else [])],
                                         a.dry_run))
