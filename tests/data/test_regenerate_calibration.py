"""`data.calibration_sources`: answered by the regenerate stage into a directory of their own, and
fitted by the calibrate stage (real vLLM on the toy target; a fake server for the plumbing)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc.config.schema import EvalConfig
from hpc.data.regen_client import ChatClient
from hpc.data.regen_shards import read_shards
from hpc.data.regenerate import regenerate, regenerated_dir
from hpc.errors import UserError
from tests.data.test_regenerate import (  # noqa: F401 (fixtures)
    MAX_TOKENS,
    fake_rows,
    fake_url,
    make_cfg,
    write_rows,
)


def test_calibration_sources_are_answered_into_a_directory_of_their_own(fake_url, tmp_path):
    from hpc.data.calibration_set import write_calibration_set
    from hpc.data.regenerate import calibration_data, regenerate_all, regeneration_complete

    _, cal_file = write_calibration_set(EvalConfig(fixtures=True, benchmarks=["gsm8k"]), tmp_path / "cal.jsonl", 3)
    cfg = make_cfg(tmp_path, fake_rows(tmp_path / "rows.jsonl", ["a", "b"]),
                   f"data.calibration_sources=[{{path: {cal_file}}}]")
    cal = calibration_data(cfg.data)
    assert cal is not None and Path(cal.output_dir) == tmp_path / "out" / "calibration"
    client = ChatClient(fake_url, "fake", MAX_TOKENS)
    stats, cal_stats = regenerate_all(cfg.data, lambda data: regenerate(data, fake_url, client=client))
    assert (stats.written, cal_stats.written) == (2, 3)
    train_rows, cal_rows = read_shards(regenerated_dir(cfg.data)), read_shards(regenerated_dir(cal))
    assert [r["id"] for r in train_rows] == ["r0", "r1"]  # no calibration row trains
    assert [r["source"] for r in cal_rows] == ["calibration:gsm8k"] * 3
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in cal_rows)
    assert regeneration_complete(cfg.data) and regeneration_complete(cal)
    # Without calibration sources nothing else is regenerated.
    assert regenerate_all(make_cfg(tmp_path / "plain", fake_rows(tmp_path / "p.jsonl", ["c"])).data,
                          lambda data: regenerate(data, fake_url, client=client))[1] is None


def test_calibration_rows_that_were_never_regenerated_are_refused(tmp_path):
    from hpc.data.prepare import calibration_rows

    cal = fake_rows(tmp_path / "cal.jsonl", ["q"])
    cfg = make_cfg(tmp_path, fake_rows(tmp_path / "rows.jsonl", ["a"]), f"data.calibration_sources=[{{path: {cal}}}]")
    with pytest.raises(UserError, match="data.calibration_sources are not regenerated yet .*run the regenerate stage"):
        calibration_rows(cfg)


@pytest.mark.slow
def test_a_calibration_set_is_answered_by_the_target_and_calibrates_the_export(regen_server, toy_target, tmp_path, capsys):
    from transformers import AutoTokenizer

    from hpc.calibration.stage import calibrate_export
    from hpc.data.calibration_set import write_calibration_set
    from hpc.data.prepare import calibration_rows, prepare_data
    from hpc.data.regenerate import regenerate_all
    from hpc.formats.calibration import Calibration
    from hpc.model.export import export_draft
    from hpc.train.trainer import build_draft

    url, over, key = regen_server
    bench = EvalConfig(fixtures=True, benchmarks=["gsm8k", "humaneval"])
    _, cal_file = write_calibration_set(bench, tmp_path / "cal.jsonl", 4)
    cfg = make_cfg(tmp_path, write_rows(tmp_path / "rows.jsonl"), *over, "verifier.backend=hf",
                   f"data.calibration_sources=[{{path: {cal_file}}}]", f"train.output_dir={tmp_path / 'run'}")
    _, cal_stats = regenerate_all(cfg.data, lambda data: regenerate(data, url, api_key=key))
    assert cal_stats is not None and cal_stats.written == 8
    rows = calibration_rows(cfg)
    assert 0 < len(rows) <= 8 and all(sum(mask) > 0 for _, mask in rows.values())
    # Read as the evaluation decodes them: a reply past eval.max_tokens is cut there.
    import copy

    capped = copy.deepcopy(cfg)
    capped.eval.max_tokens = 3
    short = calibration_rows(capped)
    assert short.keys() == rows.keys() and any(sum(m) > 3 for _, m in rows.values())
    for i, (ids, mask) in short.items():  # and the tokens after the cut are not captured
        assert (ids, mask) == (rows[i][0][:len(ids)], rows[i][1][:len(ids)]) and mask[-1] == 1
        assert sum(mask) == min(3, sum(rows[i][1]))
    # The prompt is the benchmark's, rendered as the evaluation renders it; the target's reply follows.
    tok = AutoTokenizer.from_pretrained(toy_target)
    from hpc.formats.benchmarks import spare_prompts

    first = tok.apply_chat_template([{"role": "user", "content": spare_prompts("gsm8k", bench, 1)[0]}],
                                    add_generation_prompt=True, tokenize=True, return_dict=False)
    ids, mask = rows[0]
    assert ids[:len(first)] == list(first) and not any(mask[:len(first)])

    prepare_data(cfg)  # the draft vocabulary an (untrained) draft needs
    model, _ = build_draft(cfg.draft, str(toy_target), tmp_path / "run" / "data" / "vocab.safetensors",
                           norm=False)
    export_draft(model, tmp_path / "run" / "export")
    metrics = calibrate_export(cfg, quiet=True)
    assert metrics["calibration_rows"] == len(rows)
    assert f"fitted on {len(rows)} calibration rows" in capsys.readouterr().out
    assert Calibration.load(tmp_path / "run" / "export") is not None
