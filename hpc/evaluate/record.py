"""Evaluation runs on disk first, MLflow second.

Each (draft, n) run — and each baseline — is a directory: `run.json` (what, where, by which
engine) plus one JSON per finished benchmark. Uploading turns a directory into an MLflow
child run (metrics per benchmark, results JSON, plots). When the tracking server is down the
directory simply waits: `dspark evaluate CONFIG --upload` sends it later.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from pathlib import Path

from hpc.config.schema import BENCHMARKS, DSparkConfig
from hpc.config.secrets import scrub
from hpc.evaluate.compare import EvalRecord, card_markdown, card_table, draft_column
from hpc.evaluate.harness import LEGACY_NAMES, BenchResult, write_json_atomic
from hpc.track.keys import BASELINE_KEY, MANIFESTS, MEAN, STAGE, STAGE_BASELINE, STAGE_EVAL, metric
from hpc.track.pipeline import create_child_run, create_pipeline_run, end_pipeline_run
from hpc.track.registry import promote_if_better, register_draft


def load_results(run_dir: Path, names: Sequence[str] | None = None) -> list[BenchResult]:
    """The benchmarks `names`, or those run.json lists (the last evaluation's), or every file: a
    benchmark a later config dropped keeps its file here, and must not count in this run."""
    if names is None and (run_dir / "run.json").is_file():
        names = json.loads((run_dir / "run.json").read_text()).get("benchmarks")
    out = [BenchResult.from_json(json.loads(p.read_text())) for p in run_dir.glob("*.json")
           if p.name != "run.json" and (names is None or p.stem in names)]
    order = {b: i for i, b in enumerate(BENCHMARKS)}
    return sorted(out, key=lambda r: (order.get(r.benchmark, len(order)), r.benchmark))


def run_metrics(results: list[BenchResult]) -> dict[str, float]:
    m: dict[str, float] = {}
    for r in results:
        b = r.benchmark
        m[metric(b, "tok_s")], m[metric(b, "rows")], m[metric(b, "output_tokens")] = r.tok_s, r.rows, r.output_tokens
        if r.baseline_tok_s is not None:
            m[metric(b, "baseline_tok_s")] = r.baseline_tok_s
        if r.speedup is not None:
            m[metric(b, "speedup")] = r.speedup
        if r.speedup_lo is not None and r.speedup_hi is not None:  # paired timing: the quartiles of the per-pair ratios
            m[metric(b, "speedup_lo")], m[metric(b, "speedup_hi")], m[metric(b, "pairs")] = \
                r.speedup_lo, r.speedup_hi, r.pairs
        if r.accept_len is not None:
            m[metric(b, "accept_len")] = r.accept_len
        for i, p in enumerate(r.per_position, start=1):
            m[metric(b, f"accept_pos_{i}")] = p
    for key in ("accept_len", "speedup", "tok_s"):
        vals = [getattr(r, key) for r in results if getattr(r, key) is not None]
        if vals:
            m[metric(MEAN, key)] = statistics.mean(vals)
    return m


def eval_records(runs: Iterable[list[BenchResult]]) -> list[EvalRecord]:
    """The records `dspark compare` reads back from MLflow, made from the runs' results (one list
    per run directory): the evaluation prints the card it measured with tracking off too.
    Baselines are no column: their tok/s reach the card through each draft's baseline_tok_s."""
    out = []
    for results in runs:
        if not results or not results[0].n:
            continue
        r = results[0]
        out.append(EvalRecord("", draft_column(r.label, r.method), r.n, run_metrics(results), r.method, r.engine,
                              r.temperature, r.confidence))
    return out


def card_text(runs: Iterable[list[BenchResult]]) -> str:
    """The card as `dspark compare` prints it for these runs; empty when no draft ran."""
    evals = eval_records(runs)
    return card_markdown(card_table(evals), evals) if evals else ""


def upload_run(client, run_dir: Path, extra_artifacts: Sequence[tuple[str, str | None]] = (),
               parent: str | None = None) -> str:
    """Create (once) the MLflow run for a run directory; returns its id. `parent` is the pipeline
    run for a directory that has none: saved with the run id, so a failed upload's retry does
    not attach to the pipeline run that failed with it."""
    meta = json.loads((run_dir / "run.json").read_text())
    if meta.get("mlflow_run_id"):
        return meta["mlflow_run_id"]
    results = load_results(run_dir)
    tags = {STAGE: meta["stage"], **meta["tags"],
            MANIFESTS: json.dumps({r.benchmark: r.sha256 for r in results}, sort_keys=True)}
    meta["parent_run_id"] = meta.get("parent_run_id") or parent
    run_id = create_child_run(client, meta["experiment"], meta["parent_run_id"], meta["name"], tags)
    try:
        _log_run(client, run_id, run_dir, meta, results, extra_artifacts)
    except BaseException:
        # Half-logged, it would stay RUNNING, fail its pipeline's outcome, and be duplicated by
        # the retry: delete it; the directory stays pending for `dspark evaluate --upload`.
        try:
            client.delete_run(run_id)
        except Exception:  # noqa: BLE001 - the first error is the one to report
            pass
        raise
    meta["mlflow_run_id"] = run_id
    write_json_atomic(run_dir / "run.json", meta)
    return run_id


def _log_run(client, run_id: str, run_dir: Path, meta: dict, results: list[BenchResult],
             extra_artifacts: Sequence[tuple[str, str | None]]) -> None:
    from mlflow.entities import Metric, Param  # mlflow: loaded only on this path

    metrics = [Metric(k, float(v), 0, 0) for k, v in run_metrics(results).items()]
    params = [Param(k, str(v)) for k, v in meta.get("params", {}).items()]
    for i in range(0, max(len(metrics), len(params), 1), 100):
        client.log_batch(run_id, metrics=metrics[i:i + 100], params=params[i:i + 100])
    with tempfile.TemporaryDirectory() as tmp:  # one results.json artifact for the whole run
        combined = Path(tmp) / "results.json"
        combined.write_text(json.dumps({"run": meta, "results": [asdict(r) for r in results]}, indent=1))
        client.log_artifact(run_id, str(combined))
    for path in sorted(run_dir.glob("*.png")):
        client.log_artifact(run_id, str(path), "plots")
    for path, artifact_path in list(meta.get("artifacts", [])) + list(extra_artifacts):
        if Path(path).is_dir():
            client.log_artifacts(run_id, path, artifact_path)
        elif Path(path).is_file():
            client.log_artifact(run_id, path, artifact_path)
    client.set_terminated(run_id)


def results_digest(results: list[BenchResult]) -> str:
    """What a run directory's MLflow run was made from: re-measured results need a new one."""
    blob = json.dumps(sorted((_digest_view(r) for r in results), key=lambda d: d["benchmark"]), sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _digest_view(r: BenchResult) -> dict:
    """The result under the key names its file had before the counts were renamed, without the
    drafted tokens (or per-prompt counts) such a file did not keep: a directory measured then keeps its MLflow run on a
    requeue, instead of being logged again as re-measured."""
    d = asdict(r)
    for old, new in LEGACY_NAMES.items():
        d[old] = d.pop(new)
    if d["drafted_tokens"] is None:
        del d["drafted_tokens"]
    if not d["confidence"]:  # nor the confidence reading, which files without a head never had
        del d["confidence"]
    if not d["per_prompt"]:  # nor per-prompt counts, which files before them never had
        del d["per_prompt"]
    return d


def pending_runs(out_dir: Path, cfg: DSparkConfig | None = None) -> list[Path]:
    """Run directories not in MLflow yet; with `cfg`, also those uploaded whose draft the
    registry still lacks (a registration that failed after the upload)."""
    out = []
    for p in sorted(out_dir.glob("*/run.json")):
        meta = json.loads(p.read_text())
        if not meta.get("mlflow_run_id") or (cfg is not None and _registrable(meta, cfg) and "registered" not in meta):
            out.append(p.parent)
    return out


def _registrable(meta: dict, cfg: DSparkConfig) -> bool:
    """Our draft at the largest n, greedy: the registry ranks drafts by greedy acceptance, so
    sampled runs are reported, not ranked."""
    return bool(meta["stage"] == STAGE_EVAL and meta.get("artifacts") and not meta.get("temperature")
                and meta.get("n") == max(cfg.eval.num_speculative_tokens))


def find_baseline(client, experiment: str, key: str) -> dict[str, float] | None:
    """tok/s per benchmark from a baseline logged earlier under the same key, if any."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return None
    runs = client.search_runs([exp.experiment_id], filter_string=(
        f"tags.`{STAGE}` = '{STAGE_BASELINE}' and tags.`{BASELINE_KEY}` = '{key}'"),
        order_by=["attributes.start_time DESC"], max_results=1)
    if not runs:
        return None
    m = runs[0].data.metrics
    return {k.split("/")[0]: v for k, v in m.items() if k.endswith("/tok_s") and not k.startswith("mean/")}


def upload_all(client, out: Path, cfg: DSparkConfig, quiet: bool = False, only: set[str] | None = None) -> list[str]:
    """Run directories not yet in MLflow (`only`: just these names); then the registry for our
    drafts at the largest n.

    An evaluation uploads only what it ran itself: the eval-n3 and eval-n7 jobs of one training
    task share an output directory and run at the same time.
    """
    ids = []
    orphan_parent = None  # runs evaluated while tracking was down get one pipeline run now
    try:
        for run_dir in pending_runs(out, cfg):
            if only is not None and run_dir.name not in only:
                continue
            meta = json.loads((run_dir / "run.json").read_text())
            if meta.get("mlflow_run_id"):  # uploaded; its registration failed: only that is retried
                _register(client, run_dir, meta, meta["mlflow_run_id"], promote=cfg.schedule.promote_if_better)
                continue
            if not meta.get("parent_run_id") and orphan_parent is None:
                orphan_parent = create_pipeline_run(client, cfg, f"{cfg.name}-evaluate")
            extra: list[tuple[str, str | None]] = []
            report = run_dir / "calibration.json.report"
            if report.is_file():
                extra.append((str(report), "calibration"))
            ids.append(upload_run(client, run_dir, extra, parent=orphan_parent))
            meta = json.loads((run_dir / "run.json").read_text())
            if not quiet:
                print(f"logged {meta['name']} to MLflow run {ids[-1]}")
            if _registrable(meta, cfg):
                _register(client, run_dir, meta, ids[-1], promote=cfg.schedule.promote_if_better)
    except BaseException as err:
        if orphan_parent is not None:  # it would stay RUNNING: the retry attaches to it, not to a new one
            why = scrub((str(err).splitlines() or ["?"])[0])[:160]
            end_pipeline_run(client, orphan_parent, "FAILED", f"upload failed: {why}")
        raise
    if orphan_parent is not None:
        end_pipeline_run(client, orphan_parent, "FINISHED", f"{len(ids)} evaluation run(s) uploaded after the fact")
    return ids


def _register(client, run_dir: Path, meta: dict, run_id: str, promote: bool = True) -> None:
    """Register the draft; with `promote`, move the champion to it when it is better. Without,
    the version waits in the registry for a person (or a later run) to promote it."""
    res = load_results(run_dir)
    measured = [r.accept_len for r in res if r.accept_len is not None]
    if not measured:  # vLLM exposed no spec-decode counters: nothing to rank the draft by
        print(f"registry: {meta['name']} not registered: no benchmark has an acceptance length (the engine "
              "reported no spec-decode counters); evaluate it on a build that reports them", flush=True)
        _mark_registered(run_dir, None)
        return
    score = statistics.mean(measured)
    # A retry after a failure between registering and promoting finds the version it made.
    earlier = client.search_model_versions(f"name = '{meta['registered_model']}' and run_id = '{run_id}'")
    version = str(earlier[0].version) if earlier else register_draft(
        client, meta["registered_model"], run_id, "draft", score, {r.benchmark: r.sha256 for r in res}, n=meta["n"])
    if promote:
        _, why = promote_if_better(client, meta["registered_model"], version)
    else:
        why = "champion left as it is (schedule.promote_if_better is false)"
    _mark_registered(run_dir, version)
    print(f"registry: {meta['registered_model']} v{version} (mean acceptance length {score:.3f} at n={meta['n']}); "
          f"{why}")


def _mark_registered(run_dir: Path, version: str | None) -> None:
    """Registration done (version None: nothing to register); until then `--upload` retries it."""
    meta = json.loads((run_dir / "run.json").read_text())
    write_json_atomic(run_dir / "run.json", {**meta, "registered": version})
