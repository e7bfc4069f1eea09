"""`dspark evaluate`: the card's numbers for a draft at each n, against a cached baseline.

Order of work, so that a requeue or an outage costs as little as possible:
1. everything that can be wrong is checked first (draft, n, benchmarks, tracking);
2. the no-speculation baseline per engine, reused from MLflow when one was measured for the
   same (target, engine build, hardware, manifests), unless --force-baseline;
3. each draft at each n (and, with eval.temperature > 0, also sampled at that temperature), one
   server per (draft, n, temperature), benchmarks single-stream; with eval.timing=paired the
   baseline engine runs beside it and requests alternate (harness.py), else (cached) the
   baseline of step 2 gives the speedup;
4. upload to MLflow (or keep on disk), plots, calibration report, registry;
5. the card's table for what this evaluation measured, as `dspark compare` prints it.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hpc.config.schema import DSparkConfig, EvalConfig, TrackingConfig
from hpc.config.secrets import redact_uri, scrub
from hpc.config.target import localize
from hpc.config.validate_target import target_shape
from hpc.errors import UserError
from hpc.evaluate.confidence_report import calibration_png, calibration_report, format_report
from hpc.evaluate.drafts import DraftSpec, check_ns, choose_engine, is_our_export, our_draft, vllm_build
from hpc.evaluate.engines import ReferenceEngine, VLLMEngine
from hpc.evaluate.hardware import hardware_id
from hpc.evaluate.harness import BenchResult, attach_baseline, finished, run_benchmarks, timing_of, write_json_atomic
from hpc.evaluate.record import card_text, find_baseline, load_results, results_digest, upload_all
from hpc.formats.benchmarks import load_benchmark
from hpc.formats.calibration import FILE as CALIBRATION_FILE
from hpc.track.keys import (
    BASELINE_KEY,
    CONFIDENCE,
    DRAFT,
    DRAFT_SHA256,
    ENGINE,
    ENGINE_VERSION,
    HARDWARE,
    METHOD,
    SPEC_N,
    STAGE_BASELINE,
    STAGE_EVAL,
    TEMPERATURE,
    TIMING,
    VLLM_VERSION,
)
from hpc.track.pipeline import common_tags, create_pipeline_run, ends
from hpc.track.plots import per_position_png
from hpc.track.server import is_healthy
from hpc.verifier.vllm_server import config_flags, server_env, start_vllm_server

if TYPE_CHECKING:
    from hpc.evaluate.engines import ReferenceEngine, VLLMEngine


@dataclass
class Job:
    draft: DraftSpec | None  # None: the baseline
    n: int
    engine: str
    temperature: float = 0.0
    adaptive: bool = False  # vLLM's adaptive verification, up to n drafts (eval-adaptive on a GPU vLLM)

    @property
    def name(self) -> str:
        suffix = f"-t{self.temperature:g}" if self.temperature > 0 else ""
        if self.draft is None:
            return f"baseline-{self.engine}{suffix}"
        mode = "adaptive" if self.adaptive else f"n{self.n}"
        return f"eval-{mode}-{re.sub(r'[^A-Za-z0-9_.-]+', '_', self.draft.label)}{suffix}"

    def speculative_config(self) -> dict:
        assert self.draft is not None
        spec = self.draft.speculative_config(self.n, self.temperature)
        if self.adaptive:
            spec["enable_adaptive_verification"] = True
        return spec


def _tracking(tracking: TrackingConfig):
    """An MLflow client, or None (one warning line) when the server does not answer."""
    from mlflow.tracking import MlflowClient  # mlflow: loaded only on this path

    client = MlflowClient(tracking.uri)
    try:
        if tracking.uri.startswith("http") and not is_healthy(tracking.uri):
            raise ConnectionError("no answer")
        client.search_experiments(max_results=1)
    except Exception as err:  # noqa: BLE001 - any failure: evaluate anyway, upload later
        print(f"warning: tracking server {redact_uri(tracking.uri)} unreachable ({scrub(str(err).splitlines()[0])[:120]}); "
              f"evaluating anyway, results stay on disk for `dspark evaluate CONFIG --upload`", flush=True)
        return None
    return client


def baseline_key(cfg: DSparkConfig, engine: str, engine_version: str, hardware: str, benches,
                 temperature: float = 0.0) -> str:
    """What a cached baseline's tok/s depends on: the target, the engine build, the hardware, the
    prompts, and how the engine serves (vLLM's flags: TP, compilation, extra args; the reference
    loop's device). A baseline measured at TP=8 is no baseline for TP=4."""
    v = cfg.verifier
    serving = [*config_flags(v), *v.extra_args] if engine == "vllm" else ["--device", cfg.eval.device]
    ident: dict[str, object] = {"target": v.name or v.model, "revision": v.revision, "engine": engine,
                                "version": engine_version, "hardware": hardware, "serving": serving,
                                "manifests": {b.name: b.sha256 for b in benches}}
    if temperature > 0:
        ident["temperature"] = temperature
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]


class EngineFactory:
    """Starts what a job runs on; the HF target for the reference engine is loaded once."""

    def __init__(self, cfg: DSparkConfig, out: Path):
        self.cfg, self.out = cfg, out
        self._target = None
        self._baselines: dict[tuple[str, float], ReferenceEngine | VLLMEngine] = {}

    def target(self):
        if self._target is None:
            import torch  # torch: loaded only on this path
            from transformers import AutoModelForCausalLM  # transformers: loaded only on this path

            v = self.cfg.verifier
            self._target = AutoModelForCausalLM.from_pretrained(
                v.model, dtype=torch.float32, trust_remote_code=v.trust_remote_code, use_safetensors=True,
            ).to(self.cfg.eval.device).eval()  # type: ignore[arg-type]  # transformers' .to typing loses self
        return self._target

    def baseline(self, engine: str, temperature: float, eos: int | None):
        """The no-draft engine paired timing alternates with: started once, shared by every job."""
        key = (engine, temperature)
        if key not in self._baselines:
            self._baselines[key] = self.start(Job(None, 0, engine, temperature), eos)
        return self._baselines[key]

    def close(self) -> None:
        for engine in self._baselines.values():
            engine.close()
        self._baselines.clear()

    def start(self, job: Job, eos: int | None) -> ReferenceEngine | VLLMEngine:
        seed = self.cfg.eval.seed
        if job.engine == "reference":
            draft = None
            if job.draft is not None:
                from hpc.model.export import load_draft  # safetensors, torch: loaded only on this path

                assert job.draft.model is not None  # the reference engine decodes our exports: directories
                draft = load_draft(job.draft.model, device=self.cfg.eval.device).eval()
            return ReferenceEngine(self.target(), draft, job.n, eos, job.temperature, seed,
                                   confidence=_value(self.cfg.eval.confidence))

        v = self.cfg.verifier
        spec = ["--speculative-config", json.dumps(job.speculative_config())] if job.draft else []
        server = start_vllm_server(v.python, v.model, host=v.host, port=v.port or None, base_args=config_flags(v),
                                   extra_args=[*spec, *v.extra_args], env=server_env(v),
                                   log_path=self.out / "logs" / f"{job.name}.log", timeout=v.health_timeout_s)
        return VLLMEngine(server, temperature=job.temperature, seed=seed)


def check_draft_fits_target(path: Path, cfg: DSparkConfig) -> None:
    """A draft trained for another target fails here, before any server starts (not after the
    baseline has run): its vocabulary, hidden size and aux layers must be the target's."""
    d = json.loads((path / "config.json").read_text())
    shape = target_shape(cfg)
    layer = d.get("transformer_layer_config", {})
    checks = [("vocab size", layer.get("vocab_size"), shape.vocab_size),
              ("hidden size", d.get("target_hidden_size") or layer.get("hidden_size"), shape.hidden_size)]
    for what, mine, theirs in checks:
        if mine is not None and mine != theirs:
            raise UserError(f"--draft {path}: built for a target with {what} {mine}, but {cfg.verifier.model} has "
                            f"{theirs} ({shape.source}); evaluate it against its own target")
    bad = [i for i in d.get("aux_hidden_state_layer_ids", []) if not 0 <= i <= shape.num_hidden_layers]
    if bad:
        raise UserError(f"--draft {path}: reads aux layers {bad}, beyond the {shape.num_hidden_layers} layers of "
                        f"{cfg.verifier.model}; evaluate it against its own target")


def check_side_file(path: Path, cfg: DSparkConfig) -> None:
    """A side file that belongs to another head is one line here, before any engine starts; and
    eval.confidence=side_file reads the per-position maps beside a DSpark export: without them
    the reference engine would read the served head and call it the side file's."""
    from hpc.model.export import side_file_problem  # safetensors, torch: loaded only on this path

    if (problem := side_file_problem(path)) is not None:
        raise UserError(problem)
    d = json.loads((path / "config.json").read_text())
    if (_value(cfg.eval.confidence) == "side_file" and d.get("enable_confidence_head")
            and not (path / CALIBRATION_FILE).is_file()):
        raise UserError(f"eval.confidence=side_file, but {path} has no {CALIBRATION_FILE} (the calibrate stage writes it); "
                        "run `dspark stage calibrate CONFIG`, or set eval.confidence=served")


def plan(cfg: DSparkConfig, draft_path: str | None, ns: list[int]) -> tuple[list[DraftSpec], list, str, bool]:
    """Drafts, benchmarks, vLLM version, CPU build: every check that needs no server."""
    drafts = [our_draft(draft_path, cfg.eval.label)] if draft_path else []
    for c in cfg.eval.compare:
        drafts.append(our_draft(c.model, c.name) if is_our_export(c.method, c.model)
                      else DraftSpec(c.name, c.method, c.model or None, revision=c.revision))
    for d in drafts:
        if d.ours:
            assert d.model is not None  # our exports are directories
            check_draft_fits_target(Path(d.model), cfg)
            check_side_file(Path(d.model), cfg)
    if not drafts:
        raise UserError("nothing to evaluate: give --draft PATH or list drafts under eval.compare")
    for d in drafts:
        check_ns(d, ns)

    benches = [load_benchmark(name, cfg.eval) for name in cfg.eval.benchmarks]
    engine = _value(cfg.eval.engine)
    needs_vllm = engine != "reference" or any(not d.ours for d in drafts)
    version, cpu = vllm_build(cfg.verifier.python) if needs_vllm else ("none", True)
    if cfg.eval.temperature > 0 and cpu:
        for d in drafts:
            if choose_engine(d, engine, cpu) == "vllm":
                raise UserError(
                    f"eval.temperature={cfg.eval.temperature:g}: {d.label} would run on vLLM's CPU build, which "
                    f"does not sample drafts losslessly (it accepts ~1% of them at temperature > 0); set "
                    f"eval.temperature=0, drop {d.label} from eval.compare, or evaluate it on a GPU vLLM")
    util = cfg.verifier.gpu_memory_utilization
    if (_value(cfg.eval.timing) == "paired" and not cpu and util > MAX_PAIRED_UTILIZATION
            and any(choose_engine(d, engine, cpu) == "vllm" for d in drafts)):
        # Paired timing keeps the baseline's server up beside the draft's, on the same GPUs; vLLM
        # refuses to start when less than its share of a GPU's memory is free.
        raise UserError(f"eval.timing=paired runs the baseline and the draft vLLM servers side by side on these GPUs, "
                        f"and at verifier.gpu_memory_utilization={util:g} the second cannot start; set "
                        f"eval.timing=cached (a target the size of Kimi's fits a node once), or "
                        f"verifier.gpu_memory_utilization <= {MAX_PAIRED_UTILIZATION}")
    return drafts, benches, version, cpu


def evaluate(cfg: DSparkConfig, draft_path: str | None, ns: list[int], force_baseline: bool = False,
             parent_run_id: str | None = None, quiet: bool = False) -> dict[str, list[BenchResult]]:
    from transformers import AutoTokenizer  # transformers: loaded only on this path

    drafts, benches, vllm_version, cpu_build = plan(cfg, draft_path, ns)  # the cheap checks first
    cfg = localize(cfg)  # a hub id becomes its local snapshot (a no-op inside a job: done there)
    engine_cfg = _value(cfg.eval.engine)
    temps = [0.0] + ([float(cfg.eval.temperature)] if cfg.eval.temperature > 0 else [])
    jobs = [Job(d, n, choose_engine(d, engine_cfg, cpu_build), t) for d in drafts for n in ns for t in temps]
    paired = _value(cfg.eval.timing) == "paired"
    out = Path(cfg.eval.output_dir)
    client = _tracking(cfg.tracking)
    tok = AutoTokenizer.from_pretrained(cfg.verifier.tokenizer or cfg.verifier.model,
                                        trust_remote_code=cfg.verifier.trust_remote_code)
    hardware = hardware_id()
    factory = EngineFactory(cfg, out)

    tags = common_tags(cfg)
    owned = None  # the pipeline run this evaluation made for itself: it ends it too
    if parent_run_id is None and client is not None:  # standalone: its own pipeline, so compare finds it

        parent_run_id = create_pipeline_run(client, cfg, f"{cfg.name}-evaluate")
        owned = parent_run_id
    with ends(client, owned, "evaluation"):
        results: dict[str, list[BenchResult]] = {}
        ran: list[str] = []  # run directories this evaluation wrote

        baselines: dict[tuple[str, float], dict[str, float]] = {}
        for engine, temp in sorted({(j.engine, j.temperature) for j in jobs}) if not paired else []:
            version = vllm_version if engine == "vllm" else _torch_version()
            key = baseline_key(cfg, engine, version, hardware, benches, temp)
            job = Job(None, 0, engine, temp)
            run_dir = out / f"{job.name}-{key[:8]}"
            cached = None if force_baseline or client is None else find_baseline(client, cfg.tracking.experiment, key)
            if cached is not None and set(cached) >= {b.name for b in benches}:
                print(f"baseline ({engine}): reusing the one measured for this target, build, hardware and manifests")
                baselines[engine, temp] = cached
                continue
            if force_baseline and run_dir.exists():
                shutil.rmtree(run_dir)
            res = _run_job(job, factory, benches, tok, run_dir, quiet)
            _write_meta(run_dir, cfg.tracking, job, STAGE_BASELINE, parent_run_id, {**tags, BASELINE_KEY: key,
                        ENGINE: engine, ENGINE_VERSION: version, HARDWARE: hardware,
                        TEMPERATURE: f"{temp:g}"}, res)
            baselines[engine, temp] = {r.benchmark: r.tok_s for r in res}
            results[job.name] = res
            ran.append(run_dir.name)

        prints = {d.label: d.fingerprint() for d in drafts}
        try:
            for job in jobs:
                draft = job.draft
                assert draft is not None  # jobs are draft jobs; baselines ran above or run paired beside them
                version = vllm_version if job.engine == "vllm" else _torch_version()
                # Results are keyed by the draft's content: a re-run with a retrained draft at the same
                # path measures it, instead of returning the previous draft's numbers.
                run_dir = out / f"{job.name}-{prints[draft.label][:8]}"
                res = _run_job(job, factory, benches, tok, run_dir, quiet, paired, cfg.eval.timing_min_pairs)
                if not paired:
                    attach_baseline(res, baselines[job.engine, job.temperature])
                    for r in res:  # the baseline is known now: the files carry the speedup too
                        write_json_atomic(run_dir / f"{r.benchmark}.json", asdict(r))
                job_tags = {**tags, DRAFT: draft.label, METHOD: draft.method,
                            DRAFT_SHA256: prints[draft.label],
                            SPEC_N: str(job.n), ENGINE: job.engine, ENGINE_VERSION: version,
                            HARDWARE: hardware, VLLM_VERSION: vllm_version,
                            TEMPERATURE: f"{job.temperature:g}", TIMING: _value(cfg.eval.timing)}
                if res and res[0].confidence:
                    job_tags[CONFIDENCE] = res[0].confidence
                artifacts = [(draft.model, "draft")] if draft.ours else []
                _write_meta(run_dir, cfg.tracking, job, STAGE_EVAL, parent_run_id, job_tags, res, artifacts)
                _plots(run_dir, res, job, cfg.eval)
                results[job.name] = res
                ran.append(run_dir.name)
        finally:
            factory.close()

        if client is not None:
            upload_all(client, out, cfg, quiet, only=set(ran))
        else:
            print(f"results kept in {out}; upload them with `dspark evaluate CONFIG --upload` once "
                  f"{redact_uri(cfg.tracking.uri)} answers")

    card = card_text(results.values())
    if card and not quiet:  # quiet callers (bench acceptance) print a table of their own
        print(f"\n{card}", flush=True)
    return results


def _torch_version() -> str:
    import torch  # torch: loaded only on this path

    return f"torch {torch.__version__}"


MAX_PAIRED_UTILIZATION = 0.45  # two vLLM servers on one node's GPUs, with room for the draft's own


def _value(enum_or_str) -> str:
    return enum_or_str.value if hasattr(enum_or_str, "value") else str(enum_or_str)


def _run_job(job: Job, factory: EngineFactory, benches, tok, run_dir: Path, quiet: bool, paired: bool = False,
             min_pairs: int = 1) -> list[BenchResult]:
    timing = timing_of(paired and job.draft is not None)
    if all(finished(run_dir, b, job.engine, timing) for b in benches):  # a requeue: no server for nothing
        return load_results(run_dir, [b.name for b in benches])
    baseline = factory.baseline(job.engine, job.temperature, tok.eos_token_id) if paired and job.draft else None
    engine = factory.start(job, tok.eos_token_id)
    try:
        label = "baseline" if job.draft is None else job.draft.label
        method = "none" if job.draft is None else job.draft.method
        return run_benchmarks(engine, benches, tok, run_dir, label, method, job.n, quiet, baseline=baseline,
                              min_pairs=min_pairs, temperature=job.temperature)
    finally:
        engine.close()


def _write_meta(run_dir: Path, tracking: TrackingConfig, job: Job, stage: str, parent: str | None, tags: dict,
                results: list[BenchResult], artifacts: list | None = None) -> None:
    meta_path = run_dir / "run.json"
    old = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    digest = results_digest(results)
    # A requeue that measured nothing keeps its MLflow run; re-measured results (new rows, a new
    # baseline, another benchmark set) are a new run. A directory from before digests keeps it.
    uploaded = old.get("mlflow_run_id") if old.get("digest", digest) == digest else None
    if old.get("mlflow_run_id") and not uploaded:
        print(f"{job.name}: re-measured, so it is logged as a new MLflow run (the last was {old['mlflow_run_id']})")
    meta = {"stage": stage, "name": job.name, "experiment": tracking.experiment, "parent_run_id": parent,
            "tags": tags, "artifacts": artifacts or [], "n": job.n, "temperature": job.temperature,
            "registered_model": tracking.registered_model, "benchmarks": sorted(r.benchmark for r in results),
            "digest": digest, "mlflow_run_id": uploaded}
    write_json_atomic(meta_path, meta)


def _plots(run_dir: Path, res: list[BenchResult], job: Job, eval_cfg: EvalConfig) -> None:
    label = "baseline" if job.draft is None else job.draft.label

    if job.n:
        temp = f" T={job.temperature:g}" if job.temperature > 0 else ""
        per_position_png({r.benchmark: r.per_position for r in res}, run_dir / "per_position_acceptance.png",
                         title=f"{label} n={job.n}{temp} ({job.engine})")
    steps = {r.benchmark: r.calibration_steps for r in res if r.calibration_steps}
    if steps:
        report = calibration_report(steps, eval_cfg.draft_token_cost)
        write_json_atomic(run_dir / "calibration.json.report", report)
        calibration_png(report, run_dir / "calibration.png")
        event = (f"sampled acceptance at temperature {job.temperature:g}" if job.temperature > 0
                 else "greedy match")
        reads = {"served": "the served head, as vLLM computes it", "side_file": "the side file's per-position maps"}
        how = reads.get(res[0].confidence, res[0].confidence)
        print(f"calibration of the confidence head ({how}), {label} n={job.n}, scored against the {event}:\n"
              f"{format_report(report)}")
