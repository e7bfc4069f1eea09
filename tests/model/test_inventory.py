"""The login node's tensor table (hpc.model.inventory) is the draft's own state_dict, shape for shape."""

from __future__ import annotations

import math

import pytest

from hpc.config import load_config, to_object
from hpc.model.export import shapes_only_inventory
from hpc.model.inventory import BUFFER_ITEMSIZE, draft_shapes

LAYOUTS = {
    "dspark": [],
    "dflash": ["draft.markov_rank=0", "draft.enable_confidence_head=false", "draft.confidence_head_with_markov=false",
               "draft.sample_from_anchor=false"],
    "markov only": ["draft.enable_confidence_head=false", "draft.confidence_head_with_markov=false"],
    "head without markov input": ["draft.confidence_head_with_markov=false"],
    "odd dims": ["draft.num_hidden_layers=1", "draft.num_attention_heads=6", "draft.num_key_value_heads=3",
                 "draft.head_dim=96", "draft.intermediate_size=1000", "draft.markov_rank=48",
                 "verifier.aux_layer_ids=[3, 9]"],
}


@pytest.mark.parametrize("recipe", ["configs/kimi-k2.6-dspark.yaml", "configs/toy-cpu.yaml"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_table_is_the_drafts_state_dict(recipe, layout):
    cfg = to_object(load_config(recipe, LAYOUTS[layout]))
    truth = {name: (shape, nbytes) for name, shape, _, nbytes in shapes_only_inventory(cfg.draft)}
    mine = draft_shapes(cfg)
    assert list(mine) == list(truth)  # names, and in the state_dict's order
    assert {k: s for k, s in mine.items()} == {k: s for k, (s, _) in truth.items()}
    for name, size in BUFFER_ITEMSIZE.items():
        assert math.prod(mine[name]) * size == truth[name][1]
