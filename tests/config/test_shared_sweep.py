"""Which sweeps may share one verifier: a key that changes what is captured, or which rows reach
the trainers in which order, is refused in one line naming it; a draft's own keys pass. The
ablations (submit.ablations) are three such variants, and each variant is named on the card."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc.config import load_config, to_object
from hpc.config.shared_sweep import share_problems, sweep_label

KIMI = Path(__file__).resolve().parents[2] / "configs" / "kimi-k2.6-dspark.yaml"


@pytest.mark.parametrize("key", ["verifier.aux_layer_ids", "verifier.model", "data.max_seq_len", "data.sources",
                                 "stream.dtype", "train.seed", "train.hold_out_every", "train.ranks_per_node"])
def test_a_key_that_changes_the_capture_is_one_line_naming_it(key):
    (line,) = share_problems({key: [1, 2], "train.lr": [1e-3, 3e-4]}, variants=4)
    assert line.startswith(f"sweep.{key}: changes ") and "\n" not in line


@pytest.mark.parametrize("key", ["train.lr", "train.loss.kl_weight", "train.steps", "train.warmup_steps",
                                 "draft.num_hidden_layers", "draft.markov_rank", "draft.enable_confidence_head",
                                 "train.weight_decay", "eval.num_speculative_tokens"])
def test_a_drafts_own_key_may_vary(key):
    assert share_problems({key: [1, 2]}, variants=2) == []


def test_one_variant_is_no_sweep_to_share():
    (line,) = share_problems({}, variants=1)
    assert "1 variant(s)" in line and "at least two" in line


def test_a_key_that_only_starts_like_a_capture_key_is_not_taken_for_it():
    assert share_problems({"train.seeds_per_prompt": [1, 2]}, variants=2) == []  # not train.seed


# -- the ablations (submit.ablations) and the card's name for each variant ---------------------------
def test_the_ablations_are_three_drafts_of_one_capture_each_named_on_the_card():
    from hpc.config import sweep_overrides
    from hpc.config.shared_sweep import ABLATIONS, shared_groups, train_nodes
    from tests.fixtures.recipes import resolve_recipe

    cfg = load_config(KIMI, ["submit.ablations=true", "eval.adaptive=true"])
    variants = sweep_overrides(cfg)
    assert [v[-1] for v in variants] == ["eval.label=DSpark", "eval.label=DFlash", "eval.label=Markov-only"]
    drafts = [resolve_recipe(KIMI, ["eval.adaptive=true", *v]) for v in variants]
    dspark, dflash, markov = (d.draft for d in drafts)
    assert dspark.markov_rank > 0 and dspark.enable_confidence_head
    assert dflash.markov_rank == 0 and not dflash.enable_confidence_head and not dflash.sample_from_anchor
    assert markov.markov_rank == dspark.markov_rank and not markov.enable_confidence_head
    # adaptive verification ranks by the confidence head: only DSpark, which has one, chains it
    assert [d.eval.adaptive for d in drafts] == [True, False, False]
    # nothing a variant changes is a capture key: all three share the one stream
    assert all(share_problems({k.split("=")[0]: [0, 1]}, 2) == [] for v in ABLATIONS.values() for k in v)
    typed = to_object(cfg)
    assert shared_groups(typed) == 3
    assert train_nodes(typed) == typed.cluster.verifier_nodes + 3 * typed.cluster.trainer_nodes


@pytest.mark.parametrize("extra, says", [
    (["sweep={train.lr: [1e-4, 3e-4]}"], "submit.ablations: the config also sweeps train.lr"),
    (["draft.markov_rank=0"], "submit.ablations: the base draft is not DSpark (draft.markov_rank=0"),
    (["draft.enable_confidence_head=false"], "draft.enable_confidence_head=False"),
])
def test_ablations_that_would_repeat_a_draft_or_ride_a_sweep_are_one_line(extra, says):
    from hpc.config import ConfigError
    from tests.fixtures.recipes import resolve_recipe

    with pytest.raises(ConfigError) as err:
        resolve_recipe(KIMI, ["submit.ablations=true", *extra])
    lines = [p for p in err.value.problems if p.startswith("submit.ablations")]
    assert len(lines) == 1 and says in lines[0], err.value.problems


def test_a_sweep_variant_is_named_by_what_it_sweeps():
    from hpc.config import sweep_overrides

    plain = sweep_overrides(load_config(KIMI, ["sweep={train.lr: [1e-4, 3e-4]}"]))
    assert [v[-1] for v in plain] == ['eval.label="lr=0.0001"', 'eval.label="lr=0.0003"']
    named = sweep_overrides(load_config(KIMI, ["sweep={train.lr: [1e-4]}", "eval.label=wide"]))
    assert named == [["train.lr=0.0001", 'eval.label="wide lr=0.0001"']]
    assert sweep_label(["train.loss.weight", "draft.weight"], ["1", "2"]) == "train.loss.weight=1,draft.weight=2"
