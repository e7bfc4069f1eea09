"""`dspark calibration-set`: benchmark rows no evaluation reads, rendered as the evaluation renders them."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc.cli import main
from hpc.config.schema import EvalConfig
from hpc.data.calibration_set import write_calibration_set
from hpc.data.sources import read_rows, to_messages
from hpc.errors import UserError
from hpc.formats.benchmarks import load_benchmark, spare_prompts
from tests.fixtures.recipes import NO_VLLM

ROOT = Path(__file__).resolve().parents[2]


def test_spare_prompts_are_the_rows_after_every_one_the_evaluation_reads():
    cfg = EvalConfig(fixtures=True)
    every = load_benchmark("gsm8k", EvalConfig(fixtures=True, rows=100)).prompts  # rendered, in file order
    evaluated = load_benchmark("gsm8k", cfg).prompts
    spare = spare_prompts("gsm8k", cfg, 100)
    assert evaluated == every[:6] and spare == every[6:] and len(spare) == 14
    assert spare[0].endswith("put your final answer within \\boxed{}.")  # the evaluation's template
    assert spare_prompts("gsm8k", cfg, 3) == every[6:9]
    # A run evaluating more rows than the manifest's count reserves them too; fewer reserve the count.
    assert spare_prompts("gsm8k", EvalConfig(fixtures=True, rows=10), 100) == every[10:]
    assert spare_prompts("gsm8k", EvalConfig(fixtures=True, rows=2), 100) == every[6:]


def test_a_benchmark_evaluated_in_full_spares_only_rows_outside_its_window():
    cfg = EvalConfig(fixtures=True)
    # LiveCodeBench's problems from other contest dates (the manifest's spare_outside) are its own
    # distribution: the sixteen fixture rows outside the window, never the eight inside it.
    spare = spare_prompts("livecodebench", cfg, 100)
    assert len(spare) == 16 and not set(spare) & set(load_benchmark("livecodebench", cfg).prompts)
    assert spare_prompts("livecodebench", cfg, 1) == spare[:1]
    # SPEED-Bench's other categories (writing, ...) are not coding: none.
    assert spare_prompts("speedbench_coding", cfg, 100) == []


def test_spare_outside_must_name_a_filter():
    import dataclasses

    from hpc.formats.benchmarks import _check_manifest, load_manifest

    bad = dataclasses.replace(load_manifest("livecodebench"), spare_outside=["contest_id"])
    with pytest.raises(ValueError, match=r"spare_outside names \['contest_id'\], which are not filters"):
        _check_manifest(bad)


def test_the_set_is_single_turn_conversations_in_the_training_data_shape(tmp_path):
    cfg = EvalConfig(fixtures=True, benchmarks=["gsm8k", "humaneval", "speedbench_coding"])
    counts, path = write_calibration_set(cfg, tmp_path / "cal.jsonl", 5)
    assert counts == {"gsm8k": 5, "humaneval": 5, "speedbench_coding": 0}
    rows = list(read_rows(str(path)))
    assert [r["source"] for r in rows] == ["calibration:gsm8k"] * 5 + ["calibration:humaneval"] * 5
    msgs = [to_messages(r) for r in rows]
    assert all(len(m) == 1 and m[0]["role"] == "user" for m in msgs)  # the regenerate stage answers them
    assert [m[0]["content"] for m in msgs[5:]] == spare_prompts("humaneval", cfg, 5)
    humaneval = load_benchmark("humaneval", cfg).prompts
    assert not set(humaneval) & {m[0]["content"] for m in msgs}
    assert [p.name for p in tmp_path.iterdir()] == ["cal.jsonl"]  # written atomically: no temp file left


def test_bad_input_is_one_line_naming_the_fix(tmp_path):
    with pytest.raises(UserError, match="--rows 0: give at least 1 row per benchmark"):
        write_calibration_set(EvalConfig(fixtures=True), tmp_path / "cal.jsonl", 0)
    with pytest.raises(UserError, match="no benchmark of eval.benchmarks=.*has rows that evaluation does not read"):
        write_calibration_set(EvalConfig(fixtures=True, benchmarks=["speedbench_coding"]), tmp_path / "cal.jsonl", 4)
    assert not (tmp_path / "cal.jsonl").exists()


def test_the_command_prints_what_it_wrote_and_the_key_to_set(tmp_path, capsys):
    out = tmp_path / "cal.jsonl"
    # The config may already name the file it is about to write.
    code = main(["calibration-set", str(ROOT / "configs" / "kimi-k2.6-dspark.yaml"), str(out), "--rows", "3",
                 "eval.fixtures=true", "eval.benchmarks=[aime,speedbench_coding]",
                 f"data.calibration_sources=[{{path: {out}}}]", *NO_VLLM])
    printed = capsys.readouterr().out
    assert code == 0 and len(out.read_text().splitlines()) == 3
    assert "aime: 3 rows" in printed and "speedbench_coding: 0 rows (evaluated in full" in printed
    assert f"data.calibration_sources=[{{path: {out}}}]" in printed


def test_a_calibration_row_is_capped_as_its_benchmark_is_evaluated():
    from hpc.data.calibration_set import decoded_tokens

    cfg = EvalConfig(max_tokens=100, code_max_tokens=30)
    assert decoded_tokens({"source": "calibration:gsm8k"}, cfg) == 100
    assert decoded_tokens({"source": "calibration:livecodebench"}, cfg) == 30
    assert decoded_tokens({"source": "calibration:nope"}, cfg) is None
    assert decoded_tokens({"source": "traffic"}, cfg) is None and decoded_tokens({}, cfg) is None
