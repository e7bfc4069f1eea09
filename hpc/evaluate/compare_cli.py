"""`dspark compare`: the published card, read back from MLflow: the table of drafts (and
retrains) at each n, the equal-budget table of a pipeline's ablations, and adaptive verification.
The tables are built by pure functions (`hpc.evaluate.compare`, `equal_budget`, `adaptive_card`);
only this command and `fetch_*` talk to MLflow.
"""

from __future__ import annotations

import argparse
import os

from hpc.config import load_config
from hpc.errors import UserError
from hpc.evaluate.adaptive_card import adaptive_markdown, fetch_adaptive
from hpc.evaluate.compare import card_markdown, card_table, fetch_evals, find_pipelines, pipeline_labels, to_csv
from hpc.evaluate.equal_budget import equal_budget_markdown, mlflow_per_prompt
from hpc.track.store import missing_store


def _tracking(args: argparse.Namespace) -> tuple[str, str]:
    uri, experiment = args.tracking_uri, args.experiment
    if args.config:
        # Only the tracking section matters here: a config whose model or data paths live on
        # the cluster must still name its tracking server on a laptop.
        cfg = load_config(args.config, [])
        uri, experiment = uri or cfg.tracking.uri, experiment or cfg.tracking.experiment
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise UserError("no tracking server: pass --tracking-uri URI or a CONFIG (or set MLFLOW_TRACKING_URI)")
    return uri, experiment or "dspark"


def run(args: argparse.Namespace) -> int:
    from mlflow.exceptions import MlflowException  # mlflow: loaded only on this path
    from mlflow.tracking import MlflowClient  # mlflow: loaded only on this path

    uri, name = _tracking(args)
    if (why := missing_store(uri)) is not None:
        raise UserError(why)
    # A dead server should fail in seconds, not after MLflow's minutes of backoff.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    client = MlflowClient(uri)
    try:
        experiment = client.get_experiment_by_name(name)
        if experiment is None or experiment.lifecycle_stage != "active":
            raise UserError(f"no experiment '{name}' at {uri}; pass --experiment or fix tracking.experiment")
        pipelines = find_pipelines(client, experiment, args.pipeline or [])
        evals = fetch_evals(client, pipelines)
    except MlflowException as err:
        raise UserError(f"mlflow at {uri}: {str(err).splitlines()[0][:200]}") from err
    if not evals:
        names = ", ".join(p.info.run_name or p.info.run_id for p in pipelines)
        raise UserError(f"pipeline {names} has no eval runs (dspark.stage=eval); run `dspark evaluate` first")
    table = card_table(evals)
    if args.csv:
        print(to_csv(table))
        return 0

    adaptive = adaptive_markdown(fetch_adaptive(client, pipelines, pipeline_labels(pipelines)))
    print(card_markdown(table, evals) + equal_budget_markdown(evals, mlflow_per_prompt(client)) + adaptive)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="the card's comparison table of drafts and retrains, from MLflow")
    p.add_argument("config", nargs="?", help="YAML config: its tracking.uri and tracking.experiment are the defaults")
    p.add_argument("--experiment", help="MLflow experiment (default: the config's, else 'dspark')")
    p.add_argument("--pipeline", action="append", metavar="RUN",
                   help="pipeline run id, id prefix or run name; repeat to compare retrains (default: the latest)")
    p.add_argument("--csv", action="store_true", help="print CSV instead of markdown")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: the config's, else $MLFLOW_TRACKING_URI)")
    p.set_defaults(func=run)
