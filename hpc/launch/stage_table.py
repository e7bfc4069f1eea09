"""The pipeline's stages, declared once: name, entry, dependencies, resources.

`dspark submit` lays its Slurm jobs out from `jobs(cfg)`; inside a job, submitit's pickled
call (`run_stage`) and `dspark stage NAME` (what sbatch/ runs) dispatch through `STAGES`;
`dspark-dev demo` runs the same entries in the same order on one machine (`local=True`); and
`dspark status` lists a pipeline's jobs in this order. docs/pipeline-dag.md explains the
dependency types.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hpc.config.schema import ClusterConfig, DSparkConfig
from hpc.config.secrets import scrub, scrubbed_traceback
from hpc.config.shared_sweep import shared_groups
from hpc.errors import EXIT_REQUEUE, UserError
from hpc.formats import draft_failure
from hpc.launch.launch_checks import resolve
from hpc.launch.node_setup import localize_stage
from hpc.launch.stages import adaptive_stage, calibrate_stage, eval_stage, regenerate_stage, report_stage, train_allocation
from hpc.launch.variants import check_variant_file

# entry(cfg, parent_run_id, n, local) -> exit code; n is set for per-n stages only
Entry = Callable[[DSparkConfig, str | None, int | None, bool], int]


@dataclass(frozen=True)
class Stage:
    name: str
    entry: Entry
    after: tuple[tuple[str, str], ...] = ()  # (Slurm dependency type, stage name)
    nodes: Callable[[ClusterConfig], int] = lambda cluster: 1  # from the config's `cluster` section
    gpus: bool = True
    kill_on_bad_exit: bool = False  # srun ends the allocation when one node's task fails
    per_variant: bool = True  # an array task per sweep variant; else one job (variant 0)
    per_n: bool = False  # one job per eval.num_speculative_tokens, named NAME-nN
    localize: bool = True  # stage the target/data on node-local storage first
    enabled: Callable[[DSparkConfig], bool] = lambda cfg: True


def _regenerate(cfg: DSparkConfig, parent_run_id: str | None, n: int | None, local: bool) -> int:
    return regenerate_stage(cfg, parent_run_id, local=local)


def _train(cfg: DSparkConfig, parent_run_id: str | None, n: int | None, local: bool,
           variants: list[DSparkConfig] | None = None) -> int:
    if local:  # one machine: every rank a local process, no allocation
        from hpc.train.train_cli import train_local  # safetensors, torch: loaded only on this path

        return train_local(cfg, parent_run_id, variants)

    return train_allocation(cfg, parent_run_id, variants)


def _trained(cfg: DSparkConfig, stage: str) -> None:
    """A draft whose training failed while others shared its stream ends its later stages in
    one line (its job FAILED), before any verifier starts; the other drafts' jobs run."""
    line = draft_failure.refusal(cfg.train.output_dir, stage)
    if line is not None:
        raise UserError(line, exit_code=1)


def _calibrate(cfg: DSparkConfig, parent_run_id: str | None, n: int | None, local: bool) -> int:
    _trained(cfg, "calibrate")
    return calibrate_stage(cfg, parent_run_id)


def _eval(cfg: DSparkConfig, parent_run_id: str | None, n: int | None, local: bool) -> int:
    if n is None:
        raise UserError("the eval stage needs n (num_speculative_tokens): `dspark stage eval CONFIG --n 7`")
    _trained(cfg, "evaluate")
    return eval_stage(cfg, int(n), parent_run_id)


def _adaptive(cfg: DSparkConfig, parent_run_id: str | None, n: int | None, local: bool) -> int:
    _trained(cfg, "evaluate")
    return adaptive_stage(cfg, parent_run_id)


def _report(cfg: DSparkConfig, parent_run_id: str | None, n: int | None, local: bool) -> int:
    if parent_run_id is None:  # it reports the evals under that run, and ends it
        raise UserError("the report stage needs the pipeline's MLflow parent run: "
                        "`dspark stage report CONFIG --parent-run-id ID`")
    return report_stage(cfg, parent_run_id)


STAGES: tuple[Stage, ...] = (
    # node 0 drives Ray; its death must end the workers, hence kill_on_bad_exit
    Stage("regenerate", _regenerate, nodes=lambda c: c.regenerate_nodes, kill_on_bad_exit=True,
          per_variant=False, enabled=lambda cfg: bool(cfg.data.regenerate)),
    # V verifier + T trainer nodes; a dead role stops the allocation instead of hanging it
    Stage("train", _train, after=(("afterok", "regenerate"),),
          nodes=lambda c: c.verifier_nodes + c.trainer_nodes, kill_on_bad_exit=True),
    # one verifier on one node captures the calibration rows (or those training held out), and
    # writes the map into the export
    Stage("calibrate", _calibrate, after=(("aftercorr", "train"),),
          enabled=lambda cfg: (cfg.train.hold_out_every > 0 or bool(cfg.data.calibration_sources))
          and cfg.draft.enable_confidence_head),
    Stage("eval", _eval, after=(("aftercorr", "train"), ("aftercorr", "calibrate")), nodes=lambda c: c.eval_nodes,
          per_n=True),
    # vLLM's adaptive verification against the fixed n's, beside them (eval.adaptive)
    Stage("eval-adaptive", _adaptive, after=(("aftercorr", "train"), ("aftercorr", "calibrate")),
          nodes=lambda c: c.eval_nodes, enabled=lambda cfg: cfg.eval.adaptive),
    # the report reads MLflow only, and runs whatever the evals did
    Stage("report", _report, after=(("afterany", "eval"), ("afterany", "eval-adaptive")), gpus=False,
          per_variant=False, localize=False),
)
NAMES = tuple(s.name for s in STAGES)


def stage(name: str) -> Stage:
    for s in STAGES:
        if s.name == name:
            return s
    raise UserError(f"unknown stage {name!r}; one of {', '.join(NAMES)}")


@dataclass(frozen=True)
class Job:
    name: str  # the stage's name, or NAME-nN for a per-n stage
    stage: Stage
    n: int | None = None
    after: tuple[tuple[str, str], ...] = ()  # (dependency type, job name), enabled jobs only
    array: bool = True  # one task per variant (when the stage is per_variant); else one job
    variants: int = 1  # the variants one job trains (a shared verifier's train job: all of them)


def jobs(cfg: DSparkConfig) -> list[Job]:
    """The pipeline's jobs in submission order, with dependencies resolved to job names. With a
    shared verifier the train job is one allocation for every variant of the sweep; the
    per-variant stages after it wait for the whole of it (afterok), not for a task of the same
    index (aftercorr)."""
    out: list[Job] = []
    k = shared_groups(cfg)
    for s in STAGES:
        if not s.enabled(cfg):
            continue
        ns = list(cfg.eval.num_speculative_tokens) if s.per_n else [None]
        after = tuple(("afterok" if kind == "aftercorr" and not j.array else kind, j.name)
                      for kind, dep in s.after for j in out if j.stage.name == dep)
        one = k > 1 and s.name == "train"
        out += [Job(f"{s.name}-n{n}" if n is not None else s.name, s, n, after, array=s.per_variant and not one,
                    variants=k if one else 1) for n in ns]
    return out


def stage_of(job_name: str) -> str:
    """`eval-n7` -> `eval`: which stage a job of a pipeline ran."""
    for s in STAGES:
        if job_name == s.name or (s.per_n and job_name.startswith(f"{s.name}-n")):
            return s.name
    return job_name


def run_in_job(name: str, config_file: str, overrides: list[str] | tuple[str, ...] = (),
               parent_run_id: str | None = None, n: int | None = None, shared: tuple[str, ...] = ()) -> int:
    """One stage inside its Slurm job, from the variant's frozen YAML: its exit code. `shared`:
    the other variants' frozen YAMLs, which a shared verifier's train job trains beside it."""
    s = stage(name)
    if shared and name != "train":
        raise UserError(f"stage {name}: only the train stage trains several variants in one job")

    def load(path: str) -> DSparkConfig:
        check_variant_file(path)  # before a single key is read
        # A CPU-only stage (the report) need not see the GPUs the training config names.
        cfg = resolve(path, list(overrides), check_tracking=False, runs_here=s.gpus)
        return localize_stage(cfg) if s.localize else cfg
    cfg = load(config_file)
    if shared:
        return _train(cfg, parent_run_id, n, False, [cfg, *map(load, shared)])
    return s.entry(cfg, parent_run_id, n, False)


def run_stage(stage_name: str, config_file: str, parent_run_id: str | None = None, n: int | None = None,
              shared: tuple[str, ...] = ()) -> int:
    """The callable `dspark submit` hands to submitit. A failing stage raises, so the task
    exits non-zero and Slurm's dependencies see it."""
    try:
        code = run_in_job(stage_name, config_file, (), parent_run_id, n, tuple(shared))
    except UserError as err:
        raise UserError(scrub(str(err)), exit_code=err.exit_code) from None
    except Exception as err:
        # submitit would print the raw traceback into the job's log and its result file: it goes
        # out scrubbed here, and the cause in one line.
        import sys

        print(scrubbed_traceback(), end="", file=sys.stderr, flush=True)
        first = (str(err).splitlines() or [""])[0]
        raise UserError(f"stage {stage_name}: {type(err).__name__}: {scrub(first)[:300]}") from None
    if code not in (0, EXIT_REQUEUE):  # a failed training raised its one-line cause already
        raise UserError(f"stage {stage_name} failed with exit code {code}", exit_code=code)
    return code


# What decides the text the regenerate stage writes: it runs once, for variant 0, so a sweep over
# these would train every other variant on data made with variant 0's values. (Its servers'
# sizing, verifier.gpu_memory_utilization and the like, changes no token.)
REGENERATE_KEYS = ("data.sources", "data.calibration_sources", "data.seed", "data.regen", "data.output_dir",
                   "data.regenerate", "verifier.model", "verifier.revision", "verifier.tokenizer", "verifier.dtype")


def check_sweep_shape(cfg: DSparkConfig, variants: list[tuple[list[str], DSparkConfig]]) -> None:
    """One clear line, before anything is written or submitted, when a sweep varies what the
    tasks of one array share: the pipeline's jobs (eval.num_speculative_tokens, the calibrate
    stage's switches), or what the single regenerate job generates. `variants`: (the variant's
    overrides, its resolved config)."""
    swept = sorted(cfg.sweep or {})
    if cfg.data.regenerate:
        for key in swept:
            if key.startswith(REGENERATE_KEYS):
                raise UserError(f"sweep.{key}: the regenerate stage runs once for every variant, with the first "
                                f"variant's {key}; submit one pipeline per value (dspark submit CONFIG {key}=VALUE)")
    base = [j.name for j in jobs(cfg)]
    for extra, vcfg in variants:
        names = [j.name for j in jobs(vcfg)]
        # An ablation without a confidence head needs no calibrate or adaptive job: its task in
        # the base's arrays says so and ends (calibrate_export, adaptive_stage).
        if names != base and not (cfg.submit.ablations and set(names) <= set(base)):
            raise UserError(f"sweep {' '.join(extra)}: changes the pipeline's jobs ({', '.join(base)} -> "
                            f"{', '.join(names)}), which the tasks of one array share; submit one pipeline "
                            "per value instead")
