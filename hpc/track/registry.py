"""The model registry: every trained draft is a version; the alias `champion` marks the one to serve.

A retrain replaces the champion only if it is measurably better: a strictly higher mean
acceptance length at the same n (the config's largest, 7 in the recipes), measured on the same
benchmark manifests (same prompts, byte for byte). Scores at another n or on other manifests are
not comparable, so they never move the alias.

MLflow has no compare-and-set for aliases, and two sweep evals may promote at once, each from
its own read of the champion. So a promoter does not write "my version"; it writes the best of
every comparable version registered so far, then reads the alias back and repeats until the
alias names that best. Whichever write lands last was checked against a view that includes
every version registered before it, so the alias settles on the best one, not on the last
writer's.
"""

from __future__ import annotations

import json
import math

from hpc.errors import UserError
from hpc.track.keys import MANIFESTS

CHAMPION = "champion"
# The score's tag keeps the name it had when every score was at n=7; N_TAG says the n (a
# version without it is from then: n=7).
SCORE_TAG = "dspark.mean_accept_len_n7"
N_TAG = "dspark.spec_n"
MANIFESTS_TAG = MANIFESTS  # the key the eval run carries them under


def canonical_manifests(manifests: dict[str, str]) -> str:
    """One spelling per manifest set, so equal sets compare equal as tag strings too."""
    return json.dumps({str(k): str(v) for k, v in manifests.items()}, sort_keys=True, separators=(",", ":"))


def _is_missing(err: Exception) -> bool:
    return getattr(err, "error_code", "") == "RESOURCE_DOES_NOT_EXIST"


def register_draft(client, model_name: str, run_id: str, artifact_path: str, score: float,
                   manifests: dict[str, str], n: int = 7) -> str:
    """Register `runs:/{run_id}/{artifact_path}` as a new version of `model_name`, scored by its
    mean acceptance length at `n`; returns the version."""
    from mlflow.exceptions import MlflowException  # mlflow: loaded only on this path

    if not math.isfinite(score):
        raise UserError(f"register_draft: score = {score} for run {run_id}; "
                        f"pass the run's finite mean/accept_len at n={n}")
    try:
        client.get_registered_model(model_name)
    except MlflowException as err:
        if not _is_missing(err):
            raise
        try:
            client.create_registered_model(model_name)
        except MlflowException as race:  # another job registered it between our two calls
            if getattr(race, "error_code", "") != "RESOURCE_ALREADY_EXISTS":
                raise
    tags = {SCORE_TAG: repr(float(score)), N_TAG: str(n), MANIFESTS_TAG: canonical_manifests(manifests)}
    mv = client.create_model_version(model_name, f"runs:/{run_id}/{artifact_path}", run_id=run_id, tags=tags)
    return str(mv.version)


def _score(mv) -> float | None:
    try:
        return float(mv.tags[SCORE_TAG])
    except (KeyError, ValueError):
        return None


def _manifests(mv) -> tuple[dict, str] | None:
    """What a score was measured on: (benchmark manifests, n); scores compare only when equal."""
    try:
        return json.loads(mv.tags[MANIFESTS_TAG]), _n(mv)
    except (KeyError, ValueError):
        return None


def _n(mv) -> str:
    return mv.tags.get(N_TAG, "7")


def _best(client, model_name: str, manifests: tuple | None, incumbent: str) -> tuple[str, float]:
    """The best version measured on `manifests`: highest score; a tie keeps the incumbent,
    then the earliest version, so equal drafts never flap."""
    found = []
    for mv in client.search_model_versions(f"name='{model_name}'"):
        score = _score(mv)
        if score is not None and _manifests(mv) == manifests:
            found.append((score, str(mv.version) == incumbent, -int(mv.version), str(mv.version)))
    score, _, _, version = max(found)
    return version, score


def _champion(client, model_name: str):
    if CHAMPION not in (client.get_registered_model(model_name).aliases or {}):
        return None
    return client.get_model_version_by_alias(model_name, CHAMPION)


def _settle(client, model_name: str, manifests: tuple | None, rounds: int = 10) -> str:
    """Point the alias at the best comparable version until a read-back agrees."""
    for _ in range(rounds):
        champ = _champion(client, model_name)
        if champ is not None and _manifests(champ) != manifests and _score(champ) is not None:
            return str(champ.version)  # another manifest set took over meanwhile: not ours to judge
        incumbent = str(champ.version) if champ is not None else ""
        best, _ = _best(client, model_name, manifests, incumbent)
        if best == incumbent:
            return best
        client.set_registered_model_alias(model_name, CHAMPION, best)
    return best


def promote_if_better(client, model_name: str, version: str) -> tuple[bool, str]:
    """Point `champion` at `version` if it beats the champion; (moved?, why) either way."""
    from mlflow.exceptions import MlflowException  # mlflow: loaded only on this path

    version = str(version)
    try:
        client.get_registered_model(model_name)
        new = client.get_model_version(model_name, version)
    except MlflowException as err:
        if _is_missing(err):
            raise UserError(f"registered model {model_name!r} has no version {version}; register it first") from err
        raise
    new_score = _score(new)
    if new_score is None:
        raise UserError(f"{model_name} v{version} has no numeric {SCORE_TAG} tag; register it with register_draft")
    new_manifests, at = _manifests(new), f"at n={_n(new)}"
    champ = _champion(client, model_name)
    if champ is None:
        now = _settle(client, model_name, new_manifests)
        if now == version:
            return True, f"v{version} is champion: there was none ({new_score:.2f} {at})"
        return False, f"champion is v{now}, registered meanwhile with a better score than v{version}"
    old, old_score = str(champ.version), _score(champ)
    if old == version:
        return False, f"v{version} is already champion"
    if old_score is None:
        # Refuse rather than guess: an untagged champion was set by hand and stays until a person moves it.
        return False, f"champion stays v{old}: it has no {SCORE_TAG} tag to compare v{version} against"
    if new_manifests is None or new_manifests != _manifests(champ):
        where = "on different manifests" if _n(new) == _n(champ) else "at a different n"
        return False, (f"champion stays v{old}: v{version} ({new_score:.2f} {at}) was measured {where} "
                       f"than v{old} ({old_score:.2f} at n={_n(champ)})")
    now = _settle(client, model_name, new_manifests)
    if now == version:
        return True, f"champion moves v{old} -> v{version}: {new_score:.2f} > {old_score:.2f} {at}"
    if now == old:
        return False, f"champion stays v{old}: {old_score:.2f} >= {new_score:.2f} {at}"
    best = _score(client.get_model_version(model_name, now))
    return False, f"champion is v{now} ({best:.2f} {at}), better than v{version} ({new_score:.2f})"
