"""Which sweeps may share one verifier: a key that changes what is captured, or which rows reach
the trainers in which order, is refused in one line naming it; a draft's own keys pass."""

from __future__ import annotations

import pytest

from hpc.config.shared_sweep import share_problems


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
