"""`dspark-dev bench acceptance CONFIG`: what each part of the DSpark recipe buys, at equal budget.

Three drafts train at one budget (steps), seed, dataset and learning rate, differing only in
their heads:
- DSpark: the config's draft (Markov head, confidence head, anchor sampling);
- DFlash: the ablation without the Markov head and the confidence head, in DFlash's layout;
- Markov-only: the Markov head without the confidence head.

All three, and vLLM's ngram, are then evaluated on the same prompts at n=3 and n=7 by the
evaluation stage itself, under one MLflow parent run. The table is tau (mean acceptance
length) per benchmark and the mean; the ratios DSpark/DFlash and DSpark/ngram at n=7 are
what the recipe claims (goals: >= 1.15 and >= 1.3). A miss prints with its figures: the
loss curves and the per-position acceptance, as PNGs and in MLflow.

The confidence calibration of the drafts with a confidence head is fitted (`hpc.calibration.fit`)
on `data.calibration_sources` when the config has them (with --toy, the benchmark rows no
evaluation reads, `dspark calibration-set`, and --traffic toy conversations no training row
asks), else on every 10th training row, held out of all three trainings. DSpark's ECE per
position is judged against the goal where its count allows, cross-fitted on those rows, and
printed as greedy decoding scored it on every prompt the benchmarks evaluate.

Training runs in this process with an in-process HF verifier (`hpc_dev.offline`), so the
ablation measures the recipe, not the cluster. `--quick` checks the plumbing only.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from hpc.config import load_config, to_object
from hpc.config.schema import DSparkConfig, TrackingConfig
from hpc.config.target import localize
from hpc.errors import UserError
from hpc.evaluate.confidence_report import perfect_head_eces, position_report, reached, survival
from hpc.evaluate.engines import ReferenceEngine
from hpc.evaluate.harness import chat_ids
from hpc.evaluate.ratios import prompt_table, ratio_interval
from hpc.evaluate.runner import evaluate
from hpc.formats.benchmarks import load_benchmark
from hpc.launch.launch_checks import resolve
from hpc.launch.stages import regenerate_stage
from hpc.track.keys import DRAFT
from hpc.track.pipeline import create_child_run, create_pipeline_run, ends
from hpc.track.plots import loss_curves_png, per_position_png
from hpc_dev.bench_ratios import (  # noqa: F401 - the table's names, read as ba.* by the tests too
    NS,
    PEER,
    VARIANTS,
    evaluated_ns,
    format_table,
    interval_lines,
    mean_tau,
    parse_seeds,
    ratios,
    tau_table,
)
from hpc_dev.demo import DEMO_LR
from hpc_dev.toy import build_toy_target
from hpc_dev.toy_data import calibration_overrides, write_toy_conversations

if TYPE_CHECKING:
    from hpc.calibration.stage import Fitted

# Below this the drafts barely leave their initialisation (warm-up is a tenth of the run) and
# the ratios compare noise.
MIN_STEPS = 20
HOLD_OUT_EVERY = 10  # without calibration sources, every 10th row trains nobody: the calibration is fitted on it
ECE_GOAL = 0.05
DEFAULT_STEPS = 600  # about 2.5 min per draft on 2 cores with the toy target; 25 min in all
# --toy: traffic rows in the calibration set (of the corpus's ~3,170 questions no training row asks).
# With 1,000 a cross-fitted ECE at position 7 (259 slots) still read 0.052; with 3,000 (772), 0.021.
TRAFFIC = 3000
QUICK = ["eval.benchmarks=[gsm8k, humaneval]", "eval.rows=1", "eval.max_tokens=16", "eval.code_max_tokens=16",
         "data.regenerate=false"]


@dataclass
class Trained:
    name: str
    export: Path
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    fitted: Fitted | None = None  # the confidence calibration and its cross-fitted ECE (drafts with a head)


def check_budget(steps: int) -> None:
    if steps < MIN_STEPS:
        raise UserError(f"--steps {steps}: too few to train a draft; give at least --steps {MIN_STEPS} "
                        f"(the default, {DEFAULT_STEPS}, fits in about 25 minutes on 2 cores)")


def _resolve(config: str, overrides: list[str]):
    return resolve(config, overrides, check_tracking=False)


def _toy_overrides(out: Path, rows: int) -> list[str]:
    """The demo's setting: the toy target (built or cached), conversations drawn from its corpus,
    and the demo's learning rate (the toy recipe's 1e-3 suits longer runs)."""
    target = build_toy_target(arch="qwen3", seed=0)
    data = write_toy_conversations(out / "data" / "train.jsonl", n=rows, seed=1)
    return [f"verifier.model={target}", f"data.sources=[{{path: {data}}}]", f"data.output_dir={out / 'data'}",
            f"tracking.uri=sqlite:///{out / 'mlflow.db'}", f"train.lr={DEMO_LR}"]


def train_variant(config: str, overrides: list[str], name: str, out: Path, steps: int) -> Trained:
    from hpc.model.export import export_draft, load_draft  # safetensors, torch: loaded only on this path
    from hpc.verifier.target_files import architectures  # safetensors, torch: loaded only on this path
    from hpc_dev.offline import train_in_process  # safetensors, torch: loaded only on this path

    cfg = localize(_resolve(config, [*overrides, *VARIANTS[name], f"train.output_dir={out / name}"]))
    t = Trained(name, out / name / "export")
    t0 = time.monotonic()
    ckpt = train_in_process(cfg, steps=steps, on_step=lambda _s, m: t.losses.append(float(m["loss"])),
                            on_calibrated=lambda f: setattr(t, "fitted", f))
    t.seconds = time.monotonic() - t0
    model = cfg.verifier.model
    draft = load_draft(ckpt)
    # The export serves the head with its fold, as the calibrate stage writes it.
    draft.confidence_fold = t.fitted.fold.fold if t.fitted is not None and t.fitted.fold is not None else None
    export_draft(draft, t.export, verifier=cfg.verifier.name or model, verifier_arch=architectures(model),
                 n=max(NS))
    return t


def steps_on_every_fixture(cfg: DSparkConfig, export: Path, n: int = max(NS),
                           confidence: str = "served") -> tuple[list, int]:
    """(verify steps, prompts): the draft decoding greedily at n, as the reference engine does in
    the evaluation, over every prompt the benchmarks ship, its confidence read as `confidence`
    (eval.confidence) says. The evaluation's few rows per benchmark leave too few slots at any
    position to tell ECE from its noise floor against 0.05."""
    import torch  # torch: loaded only on this path
    from transformers import AutoModelForCausalLM, AutoTokenizer  # transformers: loaded only on this path

    from hpc.model.export import load_draft  # safetensors, torch: loaded only on this path

    every = copy.deepcopy(cfg.eval)
    every.rows = None  # each manifest's own count
    v = cfg.verifier
    target = AutoModelForCausalLM.from_pretrained(v.model, dtype=torch.float32, use_safetensors=True).eval()
    tok = AutoTokenizer.from_pretrained(v.tokenizer or v.model)
    engine = ReferenceEngine(target, load_draft(export).eval(), n, tok.eos_token_id, confidence=confidence)
    prompts = 0
    for name in every.benchmarks:
        bench = load_benchmark(name, every)
        for text in bench.prompts:
            engine.generate(chat_ids(tok, text), bench.max_tokens)
        prompts += len(bench.prompts)
    return engine.steps, prompts


def calibration_lines(steps: list, where: str, label: str = "DSpark", n: int = max(NS),
                      fitted_on: str = "held-out rows", reading: str = "side_file") -> tuple[list[str], dict[str, float]]:
    """ECE per position of `label`'s confidences at n, scored where greedy decoding read them;
    `reading` (eval.confidence) names how they were read, and prefixes the metrics of `served`."""
    if not steps:
        return [], {}
    how = {"served": "the served head, its fold fitted", "side_file": "the side file's maps, fitted"}[reading]
    lines = [f"{label} confidence at n={n} (greedy; {how} on {fitted_on}), ECE per position on {where}:"]
    prefix = "served_" if reading == "served" else ""
    metrics: dict[str, float] = {}
    for k in range(1, n + 1):
        rep = position_report(steps, k, 10)
        if not rep["count"]:
            break
        # Judged against the goal only where a perfectly calibrated head would read under it: with
        # fewer slots, ECE's upward bias alone exceeds the goal. There, an ECE above what 95% of
        # perfect heads read at this count is still a miss.
        floor, verdict = _judged(rep["ece"], [c for c, _ in reached(steps, k)], "slots")
        lines.append(f"  position {k}: ECE {rep['ece']:.3f} over {rep['count']} slots (a perfectly calibrated "
                     f"head would read {floor:.3f} at this count; mean confidence {rep['mean_conf']:.3f}, "
                     f"accepted {rep['accuracy']:.3f}): {verdict}")
        metrics[f"{prefix}ece_n{n}_pos{k}"] = rep["ece"]
        # The survival: the product of slots 1..k's confidences against "1..k all accepted", over
        # every step that drafted k (what vLLM's adaptive verification reads as a probability).
        pairs = survival(steps, k)
        surv = position_report([([c], [e]) for c, e in pairs], 1, 10)
        floor, verdict = _judged(surv["ece"], [c for c, _ in pairs], "steps")
        lines.append(f"  survival to {k}: ECE {surv['ece']:.3f} over {surv['count']} steps (perfectly calibrated: "
                     f"{floor:.3f}; said {surv['mean_conf']:.3f}, all accepted {surv['accuracy']:.3f}): {verdict}")
        metrics[f"{prefix}ece_survival_n{n}_pos{k}"] = surv["ece"]
    return lines, metrics


def _judged(ece: float, confs: list[float], what: str) -> tuple[float, str]:
    """(the floor, the verdict) of one ECE against the goal."""
    null = perfect_head_eces(confs)
    floor, q95 = sum(null) / len(null), null[int(0.95 * (len(null) - 1))]
    if floor < ECE_GOAL:
        return floor, ("meets" if ece <= ECE_GOAL else "misses") + f" the goal (<= {ECE_GOAL})"
    if ece > q95:
        return floor, f"misses: above what 95% of perfectly calibrated heads read at this count ({q95:.3f})"
    return floor, f"too few {what} to judge against {ECE_GOAL}"


def judged_lines(fitted: Fitted | None) -> tuple[list[str], dict[str, float]]:
    """The goal judged per position on the calibration rows, each half scored by the map fitted
    on the other (the calibrate stage's figure): there the slot counts can tell 0.05 from noise,
    which the benchmarks' few prompts cannot past position 2."""
    from hpc.calibration.stage import metrics  # safetensors, torch: loaded only on this path

    if fitted is None or fitted.ece is None:
        return [], {}
    lines = [f"DSpark confidence (greedy), ECE per position cross-fitted on the {fitted.rows} {fitted.where}:"]
    for k, (ece, w) in enumerate(fitted.ece["greedy"], start=1):
        if w <= 0:
            continue
        floor = fitted.greedy_floor[k - 1]
        # As on the benchmarks: where a perfect head reads over the goal, no reading can pass or fail it.
        verdict = (f"too few slots to judge against {ECE_GOAL}" if floor >= ECE_GOAL else
                   f"meets the goal (<= {ECE_GOAL})" if ece <= ECE_GOAL else f"misses the goal (<= {ECE_GOAL})")
        lines.append(f"  position {k}: ECE {ece:.3f} over {w:.0f} slots (a perfectly calibrated head would read "
                     f"{floor:.3f}): {verdict}")
    raw = (fitted.raw_survival or {}).get("greedy", [])
    side = (fitted.survival or {}).get("greedy", [])
    fold = fitted.fold.fold if fitted.fold is not None else None
    # The goal is judged on the head vLLM serves: the export's, with its fold (or raw, when none).
    served = fitted.fold.survival if fitted.fold is not None and fold is not None and fold.mode == "greedy" else raw
    if fitted.fold is not None:
        lines.append(f"  served head: {fitted.fold.why}")
    for k, (ece, w, floor) in enumerate(served or [], start=1):
        if w <= 0:
            continue
        if floor != floor and k <= len(side):  # the raw table carries no floors: the calibrated one's
            floor = side[k - 1][2]
        verdict = (f"too few blocks to judge against {ECE_GOAL}" if floor >= ECE_GOAL else
                   f"meets the goal (<= {ECE_GOAL})" if ece <= ECE_GOAL else f"misses the goal (<= {ECE_GOAL})")
        others = "; ".join(f"{name} {t[k - 1][0]:.3f}" for name, t in (("side-file maps", side), ("raw head", raw))
                           if k <= len(t) and t[k - 1][1] > 0)
        lines.append(f"  survival to {k} (the product vLLM's adaptive verification reads), served head: ECE {ece:.3f} "
                     f"over {w:.0f} blocks (a perfectly calibrated one would read {floor:.3f}; {others}): {verdict}")
    return [*lines, ""], metrics(fitted)


def per_position(results: dict, n: int) -> dict[str, list[float]]:
    """Per-position acceptance at n, averaged over benchmarks, one line per draft."""
    out = {}
    for res in results.values():
        rows = [r.per_position for r in res if r.n == n and r.per_position]
        if rows:
            out[res[0].label] = [statistics.mean(col) for col in zip(*rows)]
    return out


def bench_overrides(args: argparse.Namespace, out: Path) -> list[str]:
    """The config overrides every draft trains and evaluates with; the bench's own defaults come
    first, so an explicit setting (the user's, --quick's) wins."""
    base = [*(QUICK if args.quick else []), *args.overrides]
    overrides = [*(_toy_overrides(out, args.rows) if args.toy else []), *base]
    if args.toy:  # benchmark rows no evaluation reads (--quick does not regenerate: it holds rows out)
        overrides[:0] = calibration_overrides(args.config, out / "data", overrides, traffic=args.traffic)
    if not to_object(load_config(args.config, overrides)).data.calibration_sources:
        overrides.insert(0, f"train.hold_out_every={HOLD_OUT_EVERY}")
    # Every prompt the manifests ship, not the config's eval.rows (2 in the toy's): one DSpark draft
    # read tau 1.40 on those 12 prompts and 1.53 on the 40, where its confidence is scored too.
    overrides.insert(0, "eval.rows=null")
    return overrides


def run(args: argparse.Namespace) -> int:
    steps = args.steps if args.steps is not None else (MIN_STEPS if args.quick else DEFAULT_STEPS)
    check_budget(steps)
    if args.traffic < 0:
        raise UserError(f"--traffic {args.traffic}: give 0 or more conversations (default {TRAFFIC})")
    out = Path(args.out).resolve()
    t0 = time.monotonic()
    overrides = bench_overrides(args, out)
    cfg = _resolve(args.config, overrides)  # bad input fails here, before anything trains
    print(f"dspark-dev bench acceptance: {len(VARIANTS)} drafts x {steps} steps (lr {cfg.train.lr:g}, seed "
          f"{cfg.train.seed}) on {cfg.verifier.name or cfg.verifier.model}, then n={[max(NS)] if args.quick else list(NS)} "
          f"with {PEER} -> {out}",
          flush=True)
    seeds = parse_seeds(args.seeds) if args.seeds else None
    client, parent = _parent_run(cfg, steps, args.quick)

    with ends(client, parent, "bench acceptance"):  # a failure must not leave it RUNNING
        if seeds is None:
            _bench(args, cfg, overrides, client, parent, out, steps, t0)
        else:  # one data set, one draft per variant and seed: out/seed-S/
            tables = []
            for i, seed in enumerate(seeds):
                print(f"[{time.monotonic() - t0:5.0f}s] seed {seed} ({i + 1}/{len(seeds)})", flush=True)
                over = [*overrides, f"train.seed={seed}"]
                tables.append(_bench(args, _resolve(args.config, over), over, client, parent, out / f"seed-{seed}",
                                     steps, t0, step=i))
            lines, intervals = interval_lines(tables, seeds)
            print("\n" + "\n".join(lines))
            for rival, iv in intervals.items():
                if iv is not None:
                    for key, v in (("mean", iv.ratio), ("lo", iv.lo), ("hi", iv.hi)):
                        client.log_metric(parent, f"ratio_n{max(NS)}_seeds_{key}/DSpark_over_{rival}", v)
    print(f"bench acceptance finished in {time.monotonic() - t0:.0f}s (MLflow parent run {parent})")
    return 0


def _bench(args: argparse.Namespace, cfg: DSparkConfig, overrides: list[str], client, parent: str, out: Path,
           steps: int, t0: float, step: int = 0) -> dict:
    """Train, evaluate and report one seed; returns its per-prompt table (hpc_dev.bench_ratios)."""
    if cfg.data.regenerate:
        regenerate_stage(cfg, parent, local=True)  # one on-policy dataset for all three
    # --quick checks the plumbing: the ratios' n alone (each n is a vLLM start per draft).
    ns = [max(NS)] if args.quick else list(NS)
    trained = []
    for name in VARIANTS:
        print(f"[{time.monotonic() - t0:5.0f}s] training {name} ({steps} steps)", flush=True)
        trained.append(train_variant(args.config, overrides, name, out, steps))
        _log_variant(client, cfg.tracking, parent, trained[-1])
    by = {t.name: t for t in trained}
    compare = ", ".join([f"{{name: {n}, method: {'dflash' if n == 'DFlash' else 'dspark'}, model: '{by[n].export}'}}"
                         for n in VARIANTS if n != "DSpark"] + [f"{{name: {PEER}, method: ngram}}"])
    eval_cfg = _resolve(args.config, [*overrides, f"eval.compare=[{compare}]", f"eval.output_dir={out / 'eval'}",
                                      "eval.timing=cached", f"eval.num_speculative_tokens={ns}",
                                      f"tracking.registered_model={cfg.tracking.registered_model}-ablation"])
    print(f"[{time.monotonic() - t0:5.0f}s] evaluating on {list(eval_cfg.eval.benchmarks)}", flush=True)
    results = evaluate(eval_cfg, str(by["DSpark"].export), ns, parent_run_id=parent, quiet=True)
    table, per_prompt = tau_table(results), prompt_table(results)
    intervals = {rival: ratio_interval([per_prompt], "DSpark", rival, max(NS)) for rival in ratios(table)}
    print(format_table(table, list(eval_cfg.eval.benchmarks), intervals))
    cal_lines, cal_metrics = judged_lines(by["DSpark"].fitted)
    if by["DSpark"].export.joinpath("confidence_calibration.json").is_file():
        print(f"[{time.monotonic() - t0:5.0f}s] scoring DSpark's confidence on every benchmark prompt", flush=True)
        fitted_on = "data.calibration_sources" if cfg.data.calibration_sources else "held-out training rows"
        for reading in ("side_file", "served"):  # the per-position maps, then what vLLM computes
            decoded, prompts = steps_on_every_fixture(eval_cfg, by["DSpark"].export, confidence=reading)
            more_lines, more_metrics = calibration_lines(decoded, f"{prompts} benchmark prompts", fitted_on=fitted_on,
                                                         reading=reading)
            cal_lines, cal_metrics = [*cal_lines, *more_lines], {**cal_metrics, **more_metrics}
    print("\n".join(["", *cal_lines]) if cal_lines else "")
    if by["DSpark"].export.joinpath("config.json").is_file() and cfg.draft.enable_confidence_head:
        from hpc.evaluate.adaptive_job import evaluate_adaptive  # safetensors, torch: loaded only on this path

        print(f"\n[{time.monotonic() - t0:5.0f}s] adaptive verification at R={list(eval_cfg.eval.adaptive_concurrency)}, "
              "every benchmark prompt", flush=True)
        ada_cfg = _resolve(args.config, [*overrides, f"eval.output_dir={out / 'eval'}", "eval.rows=null",
                                         f"eval.num_speculative_tokens={ns}"])
        evaluate_adaptive(ada_cfg, str(by["DSpark"].export), parent, quiet=True)
    pngs = _figures(out, trained, results)
    for key, value in cal_metrics.items():
        client.log_metric(parent, key, value)
    _log_summary(client, parent, table, pngs, intervals, step)
    print(f"\nfigures: {', '.join(str(p) for p in pngs)}")
    return per_prompt


def _parent_run(cfg: DSparkConfig, steps: int, quick: bool):
    from mlflow.tracking import MlflowClient  # mlflow: loaded only on this path

    client = MlflowClient(cfg.tracking.uri)
    parent = create_pipeline_run(client, cfg, f"{cfg.name}-bench-acceptance",
                                 tags={"dspark.bench": "acceptance", "dspark.bench_steps": str(steps),
                                       "dspark.bench_quick": str(quick).lower()})
    return client, parent


def _log_variant(client, tracking: TrackingConfig, parent: str, t: Trained) -> None:
    from mlflow.entities import Metric  # mlflow: loaded only on this path

    run = create_child_run(client, tracking.experiment, parent, f"train-{t.name}", {DRAFT: t.name})
    now = int(time.time() * 1000)
    metrics = [Metric("loss", v, now, i) for i, v in enumerate(t.losses, start=1)]
    for i in range(0, len(metrics), 1000):
        client.log_batch(run, metrics=metrics[i:i + 1000])
    client.log_metric(run, "train_seconds", t.seconds)
    client.set_terminated(run, "FINISHED")


def _figures(out: Path, trained: list[Trained], results: dict) -> list[Path]:
    pngs = [loss_curves_png({t.name: t.losses for t in trained}, out / "loss_curves.png", "equal-budget")]
    for n in sorted({r.n for res in results.values() for r in res if r.n}):
        pngs.append(per_position_png(per_position(results, n), out / f"per_position_n{n}.png",
                                     f"n={n}, mean over benchmarks,"))
    return pngs


def _log_summary(client, parent: str, table: dict, pngs: list[Path], intervals: dict, step: int) -> None:
    """The seed's figures at MLflow step `step` (its index in --seeds); plots under bench/ (seed-S/)."""
    for label in [*VARIANTS, PEER]:
        for n in evaluated_ns(table):
            v = mean_tau(table, label, n)
            if v is not None:
                client.log_metric(parent, f"tau{n}_mean/{label}", v, step=step)
    for rival, r in ratios(table).items():
        if r is not None:
            client.log_metric(parent, f"ratio_n{max(NS)}/DSpark_over_{rival}", r, step=step)
        if (iv := intervals.get(rival)) is not None:
            client.log_metric(parent, f"ratio_n{max(NS)}_lo/DSpark_over_{rival}", iv.lo, step=step)
            client.log_metric(parent, f"ratio_n{max(NS)}_hi/DSpark_over_{rival}", iv.hi, step=step)
    for p in pngs:
        client.log_artifact(parent, str(p), f"bench/{p.parent.name}" if p.parent.name.startswith("seed-") else "bench")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="the recipe, e.g. configs/toy-cpu.yaml")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    p.add_argument("--steps", type=int, help=f"training steps per draft (default {DEFAULT_STEPS}; "
                                             f"--quick: {MIN_STEPS}; at least {MIN_STEPS})")
    p.add_argument("--quick", action="store_true",
                   help="check the plumbing: few steps, two benchmarks, short outputs, n=7 only")
    p.add_argument("--toy", action="store_true", help="build the toy target and its conversations, as `dspark-dev demo`")
    p.add_argument("--rows", type=int, default=640, help="--toy: conversations to train on (default 640)")
    p.add_argument("--traffic", type=int, default=TRAFFIC,
                   help=f"--toy: conversations no training row asks that join the calibration set (default {TRAFFIC})")
    p.add_argument("--out", default="runs/bench-acceptance")
    p.add_argument("--seeds", help="comma-separated train.seed values (e.g. 0,1,2): each trains and evaluates "
                                   "all drafts; the mean ratio gets its bootstrap interval over prompts")
