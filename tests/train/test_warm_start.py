"""Warm start (`train.init_from`): from an export directory, from the registry's champion on a
real MLflow server, with the draft vocabulary moved by target token, and a clear shape error."""

from __future__ import annotations

import uuid
from dataclasses import replace

import pytest
import torch

from hpc.config.schema import DSparkConfig
from hpc.errors import UserError
from hpc.formats.draft_args import DraftArgs
from hpc.formats.vocab_map import mapping_from_selected
from hpc.model.dspark import DSparkDraft
from hpc.model.export import export_draft, load_draft
from hpc.train.warm_start import warm_start
from tests.fixtures.draft import toy_draft_args

ARGS = toy_draft_args(draft_vocab_size=64, target_vocab_size=128, intermediate_size=96)


def draft(seed: int, args: DraftArgs = ARGS, selected: torch.Tensor | None = None) -> DSparkDraft:
    torch.manual_seed(seed)
    model = DSparkDraft(args)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()  # norms start at 1: make every tensor tell the two drafts apart
        d2t, t2d = mapping_from_selected(torch.arange(args.draft_vocab_size) if selected is None else selected,
                                         args.target_vocab_size)
        model.d2t.copy_(d2t)
        model.t2d.copy_(t2d)
    return model


@pytest.fixture
def export(tmp_path):
    return export_draft(draft(0), tmp_path / "export", "toy/target", ["Qwen3ForCausalLM"], 7)


def cfg_from(init_from: str, uri: str = "sqlite:///unused.db", model: str = "unused") -> DSparkConfig:
    cfg = DSparkConfig()
    cfg.train.init_from = init_from
    cfg.tracking.uri, cfg.tracking.registered_model = uri, model
    return cfg


def assert_same_weights(model: DSparkDraft, expected: DSparkDraft) -> None:
    want = expected.state_dict()
    for name, t in model.state_dict().items():
        assert torch.equal(t, want[name].to(t.dtype)), name


def test_warm_start_from_an_export_dir_loads_the_exported_weights(export):
    model = draft(1)
    assert not torch.equal(model.fc.weight, load_draft(export).fc.weight)
    line = warm_start(model, cfg_from(str(export)))
    assert line == f"warm start: {len(model.state_dict()) - 2} tensors from {export}"
    assert_same_weights(model, load_draft(export))  # the export is bf16: equal to what it holds


def test_warm_start_from_the_champion_downloads_its_export(export, mlflow_server):
    from mlflow.tracking import MlflowClient

    from hpc.track.registry import promote_if_better, register_draft

    client = MlflowClient(mlflow_server.uri)
    name = f"warm-{uuid.uuid4().hex[:8]}"
    run_id = client.create_run(client.create_experiment(name)).info.run_id
    client.log_artifacts(run_id, str(export), "draft")  # what evaluation logs for our drafts
    version = register_draft(client, name, run_id, "draft", 3.0, {"gsm8k": "a" * 64})
    assert promote_if_better(client, name, version)[0]
    model = draft(2)
    line = warm_start(model, cfg_from("champion", mlflow_server.uri, name))
    assert line.endswith(f"from {name} v{version}")
    assert_same_weights(model, load_draft(export))


def test_no_champion_names_the_key(mlflow_server):
    with pytest.raises(UserError, match=r"^train.init_from = 'champion': registered model 'nosuch-\w+' has no champion"):
        warm_start(draft(1), cfg_from("champion", mlflow_server.uri, f"nosuch-{uuid.uuid4().hex[:6]}"))


def test_a_shape_mismatch_is_one_line_naming_the_key(export):
    other = draft(1, replace(ARGS, intermediate_size=48))
    with pytest.raises(UserError) as err:
        warm_start(other, cfg_from(str(export)))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"train.init_from = '{export}': layers.0.mlp.")
    assert "(96, 128) there but (48, 128) in this draft" in msg


def test_this_runs_vocabulary_stays_and_vocab_rows_follow_their_tokens(export):
    # This run kept target ids 1..64 where the export kept 0..63: draft id j is token j+1 now.
    model = draft(1, selected=torch.arange(1, 65))
    fresh_last_row = model.lm_head.weight[63].clone()
    warm_start(model, cfg_from(str(export)))
    source = load_draft(export)
    assert torch.equal(model.d2t, torch.ones(64, dtype=torch.int64))  # ours, not the export's zeros
    for name in ("lm_head", "markov_head.markov_w2"):
        mine, theirs = model.get_submodule(name).weight, source.get_submodule(name).weight
        assert torch.equal(mine[:63], theirs[1:]), name
    assert torch.equal(model.lm_head.weight[63], fresh_last_row)  # token 64 was not in the export
    assert torch.equal(model.fc.weight, source.fc.weight)


def test_unset_or_bad_path(tmp_path):
    assert warm_start(draft(1), cfg_from("")) is None
    with pytest.raises(UserError, match="^train.init_from = .*not a draft export directory"):
        warm_start(draft(1), cfg_from(str(tmp_path)))
