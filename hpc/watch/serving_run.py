"""The champion as served, in MLflow: one "serving" run per champion version, a child of the
pipeline that evaluated it, with a point per watch tick and a PNG of live tau over time."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hpc.track.keys import CHAMPION_VERSION, PARENT_RUN_ID, STAGE, STAGE_SERVING
from hpc.track.plots import live_tau_png
from hpc.track.rest import Metric, RestClient
from hpc.watch.drift import Tick, Verdict
from hpc.watch.evaluated import Evaluated

LIVE_TAU = "serving/live_tau"
PLOT = "serving/live_tau.png"


def serving_run(client, ev: Evaluated, endpoints: list[str]) -> str:
    """The serving run of this champion version; made (RUNNING) on its first tick. The runs of
    earlier champions are ended: they are no longer served."""
    champion = f"{ev.model} v{ev.version}"
    found = client.search_runs([ev.experiment_id], f"tags.`{STAGE}` = '{STAGE_SERVING}'", max_results=200)
    mine = None
    for r in found:
        if r.data.tags.get(CHAMPION_VERSION) == champion:
            mine = r.info.run_id
        elif r.data.tags.get(CHAMPION_VERSION, "").startswith(f"{ev.model} v") and r.info.status == "RUNNING":
            client.set_terminated(r.info.run_id, "FINISHED")
    if mine is not None:
        return mine
    tags = {STAGE: STAGE_SERVING, CHAMPION_VERSION: champion}
    if ev.pipeline_run_id:
        tags[PARENT_RUN_ID] = ev.pipeline_run_id
    run = client.create_run(ev.experiment_id, run_name=f"serving-v{ev.version}", tags=tags)
    # The endpoints carry no credentials: validation refuses a URL with any (hpc/config/validate_ops.py).
    client.log_param(run.info.run_id, "endpoints", ",".join(endpoints)[:6000])
    client.log_param(run.info.run_id, "n", ev.n)
    client.log_param(run.info.run_id, "evaluated_run", ev.run_id)
    return run.info.run_id


def _metric_type(client):
    if isinstance(client, RestClient):
        return Metric
    from mlflow.entities import Metric as MlflowMetric  # mlflow: loaded only on this path

    return MlflowMetric


def log_tick(client, run_id: str, ev: Evaluated, verdict: Verdict, step: int, answered: int, ratio: float,
             plot_dir: Path | None = None) -> None:
    """A judged tick's point, and the plot of every point so far. An unjudged tick logs only how
    many endpoints answered: no tau is made up for it."""
    tick: Tick | None = verdict.tick
    at = int((tick.at if tick else 0) * 1000)
    values = {"serving/endpoints_answered": float(answered)}
    if tick is not None:
        values.update({LIVE_TAU: tick.live_tau, "serving/evaluated_tau": ev.tau, "serving/drafts": float(tick.drafts),
                       "serving/drop": 1.0 - tick.live_tau / ev.tau})
        for i, a in enumerate(tick.accepted_per_pos[:ev.n], start=1):
            values[f"serving/accept_pos_{i}"] = a / tick.drafts
    metric = _metric_type(client)
    client.log_batch(run_id, metrics=[metric(k, v, at, step) for k, v in values.items()])
    if tick is None:
        return
    history = sorted(client.get_metric_history(run_id, LIVE_TAU), key=lambda m: (m.timestamp, m.step))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(plot_dir or tmp) / "live_tau.png"
        live_tau_png([m.timestamp / 1000 for m in history], [m.value for m in history], ev.tau, ratio * ev.tau, out,
                     title=f"{ev.model} v{ev.version} n={ev.n}")
        client.log_artifact(run_id, str(out), "serving")
