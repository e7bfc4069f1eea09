"""The adaptive-verification evaluation: the job chained beside eval-n3 and eval-n7.

Over every benchmark's prompts, interleaved as a server would see them, at each
eval.adaptive_concurrency R it judges vLLM's adaptive rule (up to the largest n) against each
fixed n. Where the engine is vLLM (a GPU build) it runs on vLLM itself, with
`enable_adaptive_verification`, and reports what that server measures (adaptive_served). Where
it cannot (a CPU build decodes no DSpark draft) it runs on the reference engine: our export
decoded exactly, its confidence read as eval.confidence says (served: what vLLM computes), with
accepted drafts per verified draft, tokens per batched verify step and tokens per second, all
priced by one cost table (eval.adaptive_cost, or measured here).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from hpc.config.schema import DSparkConfig
from hpc.config.target import localize
from hpc.errors import UserError
from hpc.evaluate.adaptive import BatchStats, CostTable, measure_cost, replay_fixed, run_batch
from hpc.evaluate.adaptive_served import against_best, format_served, run_served, served_verdict
from hpc.evaluate.drafts import choose_engine
from hpc.evaluate.harness import chat_ids, write_json_atomic
from hpc.evaluate.reference import Decoding
from hpc.evaluate.runner import EngineFactory, Job, _value, plan
from hpc.model.export import HEAD, load_draft
from hpc.track.keys import DRAFT, DRAFT_SHA256, ENGINE, STAGE, STAGE_EVAL_ADAPTIVE
from hpc.track.pipeline import common_tags, create_child_run
from hpc.track.plots import _figure, _save

RESULTS = "adaptive.json"


def cost_table(cfg: DSparkConfig, measure) -> CostTable:
    c = cfg.eval.adaptive_cost
    if c.verify_ms and c.draft_ms:
        as_points = lambda curve: tuple((int(x), float(y)) for x, y in curve)  # noqa: E731
        return CostTable(as_points(c.verify_ms), as_points(c.draft_ms), "config (eval.adaptive_cost)")
    return measure()


def evaluate_adaptive(cfg: DSparkConfig, draft_path: str, parent_run_id: str | None = None,
                      quiet: bool = False) -> list:
    """BatchStats on the reference engine (a CPU vLLM build cannot decode DSpark), else
    ServedStats from a vLLM server per mode (adaptive_served)."""
    from transformers import AutoTokenizer  # transformers: loaded only on this path

    ns = sorted(set(cfg.eval.num_speculative_tokens))
    cfg = copy.deepcopy(cfg)
    cfg.eval.compare = []  # the peers run in the fixed-n jobs; this one judges our draft's head
    drafts, benches, _, cpu_build = plan(cfg, draft_path, ns)  # the cheap checks first
    spec = drafts[0]
    engine = choose_engine(spec, _value(cfg.eval.engine), cpu_build)
    if engine == "vllm" and _value(cfg.eval.confidence) == "side_file":
        raise UserError("eval.confidence=side_file: vLLM reads no side file, and this job runs on vLLM; set "
                        "eval.confidence=served, or eval.engine=reference to decode the side file's maps")
    if not _has_confidence_head(Path(draft_path)):
        raise UserError(f"--draft {draft_path}: has no confidence head, and adaptive verification ranks drafts by "
                        "it; set eval.adaptive=false for this draft")
    sha = spec.fingerprint()  # hashes every file of the export (GBs at Kimi scale): once
    cfg = localize(cfg)
    out = Path(cfg.eval.output_dir) / f"eval-adaptive-{sha[:8]}"
    tok = AutoTokenizer.from_pretrained(cfg.verifier.tokenizer or cfg.verifier.model,
                                        trust_remote_code=cfg.verifier.trust_remote_code)
    per_bench = [[(chat_ids(tok, text), b.max_tokens) for text in b.prompts] for b in benches]
    prompts = [p for row in _interleave(per_bench) for p in row]
    Rs, n_max = sorted(set(cfg.eval.adaptive_concurrency)), max(ns)
    head = {"draft": spec.label, "draft_sha256": sha, "engine": engine, "n_max": n_max, "prompts": len(prompts),
            "benchmarks": [b.name for b in benches]}
    if engine == "vllm":
        factory = EngineFactory(cfg, out)
        jobs = [Job(spec, n, "vllm") for n in ns] + [Job(spec, n_max, "vllm", adaptive=True)]
        served = run_served(jobs, lambda job: factory.start(job, tok.eos_token_id), prompts, Rs, 0.0,
                            cfg.eval.seed, say=lambda line: _say(quiet, line))
        report = {**head, "confidence": "served", "rows": [r.row() for r in served]}
        text = format_served(served) + "\n" + served_verdict(served, max(Rs))
        axes_of = ("accept_len", "tokens/s measured", "acceptance length (vLLM's counters)")
        rows: list = served
    else:
        batch, cost, reading = _on_reference(cfg, draft_path, out, tok, prompts, ns, Rs, quiet)
        report = {**head, "confidence": reading, "cost": cost.record(), "rows": [r.row() for r in batch]}
        text = format_rows(batch, cost.source) + "\n" + verdict(batch, cost, max(Rs), n_max)
        rows = batch
        axes_of = ("accepted_per_verified", "tokens/s under the cost table", "accepted per verified draft")
    write_json_atomic(out / RESULTS, report)
    png = adaptive_png(rows, out / "adaptive.png", f"{spec.label}: adaptive against fixed n ({engine})", axes_of)
    print(text, flush=True)
    if parent_run_id:
        _log(cfg, parent_run_id, spec.label, sha, engine, rows, report, [out / RESULTS, png])
    return rows


def _has_confidence_head(export: Path) -> bool:
    """From the safetensors headers alone: no tensor is read."""
    from safetensors import safe_open  # safetensors: loaded only on this path

    for f in sorted(export.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            if any(k in HEAD for k in st.keys()):
                return True
    return False


def _on_reference(cfg: DSparkConfig, draft_path: str, out: Path, tok, prompts, ns: list[int], Rs: list[int],
                  quiet: bool) -> tuple[list[BatchStats], CostTable, str]:
    draft = load_draft(draft_path, device=cfg.eval.device).eval()
    reading = _value(cfg.eval.confidence)
    if reading == "served":
        draft.confidence_calibration = None  # vLLM reads no side file
    target = EngineFactory(cfg, out).target()
    n_max = max(ns)
    cost = cost_table(cfg, lambda: measure_cost(target, draft, prompts[0][0], max(Rs) * (n_max + 1), max(Rs)))

    def new_request(n: int):
        def make(ids: list[int], max_tokens: int) -> Decoding:
            return Decoding(target, draft, ids, max_tokens, n, tok.eos_token_id)
        return make

    rows: list[BatchStats] = []
    for n in ns:
        traces: list[list[int]] = []
        run_batch(new_request(n), prompts, 1, n, cost, adaptive=False, traces=traces)
        rows += [replay_fixed(traces, R, n, cost) for R in Rs]
        _say(quiet, f"adaptive eval: fixed n={n} decoded ({len(prompts)} prompts)")
    for R in Rs:
        rows.append(run_batch(new_request(n_max), prompts, R, n_max, cost, adaptive=True))
        _say(quiet, f"adaptive eval: adaptive (n <= {n_max}) at R={R} decoded")
    return rows, cost, reading


def _interleave(per_bench: list[list]) -> list[list]:
    """Round robin over the benchmarks: a mixed stream, not one benchmark's tail at a time."""
    width = max((len(b) for b in per_bench), default=0)
    return [[b[i] for b in per_bench if i < len(b)] for i in range(width)]


def _say(quiet: bool, line: str) -> None:
    if not quiet:
        print(line, flush=True)


def format_rows(rows: list[BatchStats], source: str) -> str:
    head = f"{'mode':<10}{'R':>4}{'acc/verified':>14}{'tokens/step':>13}{'tok/s (costed)':>16}"
    lines = [f"adaptive verification against fixed n, priced by the cost table ({source}):", head]
    for r in sorted(rows, key=lambda r: (r.concurrency, r.mode)):
        lines.append(f"{r.mode:<10}{r.concurrency:>4}{r.accepted_per_verified:>14.3f}{r.generated_per_step:>13.2f}"
                     f"{r.tokens_per_s:>16.1f}")
    return "\n".join(lines)


def verdict(rows: list[BatchStats], cost: CostTable, R: int, n_max: int) -> str:
    """Adaptive against the best fixed n at R, and the figures that say why it gains or not:
    how many slots it verified, how often those were accepted, and what one more verified
    token costs under this cost table."""
    if (found := against_best(rows, R)) is None:
        return ""
    ada, best, ratio = found
    request_steps = sum(ada.admitted_hist)
    share = ada.verified / (request_steps * n_max) if request_steps else 0.0
    marginal = (cost.verify(R * (n_max + 1)) - cost.verify(R)) / (R * n_max) / cost.step_ms(R, 0)
    word = "beats" if ratio > 1 else "does not beat"
    return (f"at R={R} adaptive {word} the best fixed n ({best.mode}): {ratio:.3f}x its tokens/s. It verified "
            f"{share:.0%} of the slots n={n_max} would, {ada.accepted_per_verified:.3f} of them accepted against "
            f"{best.accepted_per_verified:.3f} for {best.mode}; one more verified token costs {marginal:.2%} of a "
            f"plain step under this cost table ({cost.source})")


def adaptive_png(rows: list, path: Path, title: str, axes_of: tuple[str, str, str]) -> Path:
    """tok/s against R per mode, and a second figure: (its row attribute, the tok/s axis's label,
    its own axis's label)."""
    plt = _figure()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for mode in sorted({r.mode for r in rows}):
        mine = sorted((r for r in rows if r.mode == mode), key=lambda r: r.concurrency)
        xs = [r.concurrency for r in mine]
        axes[0].plot(xs, [r.tokens_per_s for r in mine], marker="o", label=mode)
        axes[1].plot(xs, [getattr(r, axes_of[0]) for r in mine], marker="o", label=mode)
    for ax, ylabel in zip(axes, axes_of[1:]):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests R")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    _save(fig, path)
    plt.close(fig)
    return path


def _log(cfg: DSparkConfig, parent_run_id: str, label: str, sha: str, engine: str, rows: list, report: dict,
          artifacts: list[Path]) -> None:
    from mlflow.tracking import MlflowClient  # mlflow: loaded only on this path

    client = MlflowClient(cfg.tracking.uri)
    run_id = create_child_run(client, cfg.tracking.experiment, parent_run_id, "eval-adaptive",
                              {**common_tags(cfg), STAGE: STAGE_EVAL_ADAPTIVE, DRAFT: label,
                               DRAFT_SHA256: sha, ENGINE: engine})
    for r in rows:
        for key, value in r.metrics().items():
            client.log_metric(run_id, key, value)
    if "cost" in report:  # the reference engine's modelled tok/s: what priced it
        client.log_param(run_id, "cost_source", report["cost"]["source"][:250])
        client.log_param(run_id, "cost_table", json.dumps(report["cost"]["verify_ms"])[:250])
    for path in artifacts:
        client.log_artifact(run_id, str(path))
    client.set_terminated(run_id)
