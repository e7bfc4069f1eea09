"""The champion alias moves only to a strictly better draft measured on the same manifests."""

from __future__ import annotations

import uuid

import pytest
from mlflow.tracking import MlflowClient

from hpc.errors import UserError
from hpc.track.registry import CHAMPION, promote_if_better, register_draft

MANIFESTS = {"gsm8k": "a" * 64, "humaneval": "b" * 64}


@pytest.fixture
def setup(mlflow_server):
    client = MlflowClient(mlflow_server.uri)
    name = f"draft-{uuid.uuid4().hex[:8]}"
    exp_id = client.create_experiment(name)

    def register(score: float, manifests: dict[str, str] = MANIFESTS, n: int = 7) -> str:
        run_id = client.create_run(exp_id).info.run_id
        return register_draft(client, name, run_id, "draft", score, manifests, n=n)

    return client, name, register


def champion(client: MlflowClient, name: str) -> str:
    return client.get_model_version_by_alias(name, CHAMPION).version


def test_first_registration_becomes_champion(setup):
    client, name, register = setup
    v1 = register(3.10)
    assert v1 == "1"
    mv = client.get_model_version(name, v1)
    assert mv.source.startswith("runs:/") and mv.source.endswith("/draft")
    assert float(mv.tags["dspark.mean_accept_len_n7"]) == 3.10
    assert mv.tags["dspark.manifests"] == f'{{"gsm8k":"{"a" * 64}","humaneval":"{"b" * 64}"}}'
    moved, why = promote_if_better(client, name, v1)
    assert moved and champion(client, name) == "1", why
    assert promote_if_better(client, name, v1) == (False, "v1 is already champion")


def test_better_moves_worse_stays(setup):
    client, name, register = setup
    promote_if_better(client, name, register(3.10))
    v2 = register(3.25, dict(reversed(MANIFESTS.items())))  # same manifests, other key order
    assert promote_if_better(client, name, v2) == (True, "champion moves v1 -> v2: 3.25 > 3.10 at n=7")
    assert champion(client, name) == "2"
    v3 = register(3.05)
    assert promote_if_better(client, name, v3) == (False, "champion stays v2: 3.25 >= 3.05 at n=7")
    v4 = register(3.25)  # a tie is not better
    assert promote_if_better(client, name, v4) == (False, "champion stays v2: 3.25 >= 3.25 at n=7")
    assert champion(client, name) == "2"


def test_better_score_on_other_manifests_does_not_move(setup):
    client, name, register = setup
    promote_if_better(client, name, register(3.10))
    v2 = register(3.90, {**MANIFESTS, "gsm8k": "c" * 64})
    moved, why = promote_if_better(client, name, v2)
    assert not moved and why.startswith("champion stays v1:") and "different manifests" in why
    assert champion(client, name) == "1"


def test_a_score_at_another_n_does_not_move(setup):
    # A config evaluating [3, 5] registers at n=5: its tau is not comparable with one at n=7.
    client, name, register = setup
    promote_if_better(client, name, register(3.10))
    v2 = register(2.60, n=5)
    assert client.get_model_version(name, v2).tags["dspark.spec_n"] == "5"
    moved, why = promote_if_better(client, name, v2)
    assert not moved and why == "champion stays v1: v2 (2.60 at n=5) was measured at a different n than v1 (3.10 at n=7)"
    v3 = register(3.20)  # a version tagged before n was recorded counts as n=7, as its tag says
    client.delete_model_version_tag(name, "1", "dspark.spec_n")
    assert promote_if_better(client, name, v3) == (True, "champion moves v1 -> v3: 3.20 > 3.10 at n=7")


def test_unknown_version_is_a_user_error(setup):
    client, name, register = setup
    register(3.0)
    with pytest.raises(UserError, match="no version 9"):
        promote_if_better(client, name, "9")


class StaleChampion:
    """A client whose first champion read is from before another eval promoted: the race of
    two sweep evals that finish together."""

    def __init__(self, client, stale_version: str):
        self.client, self.stale, self.served = client, stale_version, False

    def get_model_version_by_alias(self, name, alias):
        if not self.served:
            self.served = True
            return self.client.get_model_version(name, self.stale)
        return self.client.get_model_version_by_alias(name, alias)

    def __getattr__(self, attr):
        return getattr(self.client, attr)


def test_two_evals_finishing_together_leave_the_better_draft_champion(setup):
    client, name, register = setup
    promote_if_better(client, name, register(3.00))
    good, worse = register(3.50), register(3.20)
    assert promote_if_better(client, name, good)[0]  # eval A promotes first
    # Eval B read the champion (v1) before A's write landed, and its draft beats v1.
    moved, why = promote_if_better(StaleChampion(client, "1"), name, worse)
    assert not moved and champion(client, name) == good, why
    assert "better than v3" in why
