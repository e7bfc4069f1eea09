"""The served draft's evaluated figures: the registry's champion, measured at the served n.

The champion's version names the eval run it was scored by, at the config's largest n. A
server may run the draft at another n; then the figure is the greedy eval run of the same draft
(by content hash) at that n, which the same pipeline made beside it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from hpc.errors import UserError
from hpc.track.keys import DRAFT_SHA256, MEAN_ACCEPT_LEN, PARENT_RUN_ID, SPEC_N, STAGE, STAGE_EVAL, TEMPERATURE
from hpc.track.registry import CHAMPION, N_TAG
from hpc.track.rest import not_found


class NoChampion(UserError):
    """The registry has no champion yet: there is nothing served to compare with."""


@dataclass(frozen=True)
class Evaluated:
    model: str
    version: str
    run_id: str  # the eval run at the served n
    pipeline_run_id: str | None  # its parent: where the serving run goes
    experiment_id: str
    n: int
    tau: float  # mean acceptance length over the benchmarks
    per_position: list[float]  # mean over the benchmarks of the acceptance rate at each position


def _per_position(metrics: dict[str, float], n: int) -> list[float]:
    out = []
    for i in range(1, n + 1):
        vals = [v for k, v in metrics.items() if k.endswith(f"/accept_pos_{i}") and not k.startswith("mean/")]
        out.append(statistics.mean(vals) if vals else float("nan"))
    return out


def champion_at(client, model: str, n: int) -> Evaluated:
    """The champion of `model` and its evaluated tau at `n`; a UserError saying what is missing."""
    try:
        mv = client.get_model_version_by_alias(model, CHAMPION)
    except Exception as err:
        if not not_found(err):
            raise
        raise NoChampion(f"tracking.registered_model = {model}: no champion in the registry to compare the served "
                        "draft with; evaluate a draft (`dspark evaluate` registers it) first") from None
    run = client.get_run(mv.run_id)
    if str(mv.tags.get(N_TAG, run.data.tags.get(SPEC_N, ""))) != str(n):
        sha = run.data.tags.get(DRAFT_SHA256)
        found = client.search_runs(
            [run.info.experiment_id],
            f"tags.`{STAGE}` = '{STAGE_EVAL}' and tags.`{SPEC_N}` = '{n}' and tags.`{DRAFT_SHA256}` = '{sha}' "
            f"and tags.`{TEMPERATURE}` = '0' and attributes.status = 'FINISHED'",
            order_by=["attributes.start_time DESC"], max_results=1) if sha else []
        if not found or MEAN_ACCEPT_LEN not in found[0].data.metrics:
            raise UserError(f"serve.num_speculative_tokens = {n}: the champion {model} v{mv.version} has no "
                            f"evaluation at n={n}; serve it at an n it was evaluated at "
                            f"(n={mv.tags.get(N_TAG, '7')}), or evaluate it at n={n} (`dspark evaluate --n {n}`)")
        run = found[0]
    m = run.data.metrics
    if MEAN_ACCEPT_LEN not in m:
        raise UserError(f"the champion {model} v{mv.version}'s eval run {run.info.run_id} has no {MEAN_ACCEPT_LEN}; "
                        "re-run its evaluation on a build that reports spec-decode counters")
    return Evaluated(model, str(mv.version), run.info.run_id, run.data.tags.get(PARENT_RUN_ID),
                     run.info.experiment_id, n, float(m[MEAN_ACCEPT_LEN]), _per_position(m, n))
