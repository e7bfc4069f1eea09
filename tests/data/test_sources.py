"""Chat rows -> token ids and an assistant-only loss mask, with the toy target's template."""

from __future__ import annotations

import json

import pytest

from hpc.data.sources import RowStats, read_rows, to_messages, tokenize_conversation, tokenize_rows
from hpc.errors import UserError


@pytest.fixture(scope="module")
def tokenizer(toy_target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(toy_target)


CONV = {"conversations": [
    {"from": "system", "value": "Be brief."},
    {"from": "human", "value": "Say hi."},
    {"from": "gpt", "value": "hi there"},
    {"from": "human", "value": "Again?"},
    {"from": "gpt", "value": "def f(): return 1"},
]}


def test_both_input_shapes_agree(tokenizer):
    msgs = {"messages": [{"role": m["from"].replace("human", "user").replace("gpt", "assistant"),
                          "content": m["value"]} for m in CONV["conversations"]]}
    assert to_messages(CONV) == to_messages(msgs)


def test_loss_mask_is_exactly_the_assistant_turns(tokenizer):
    ids, mask = tokenize_conversation(tokenizer, to_messages(CONV))
    assert len(ids) == len(mask)
    spans, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            spans.append(cur)
            cur = []
    if cur:
        spans.append(cur)
    texts = [tokenizer.decode(s) for s in spans]
    assert len(texts) == 2
    assert texts[0].startswith("hi there") and texts[1].startswith("def f(): return 1")
    # The end-of-turn marker is the assistant's to predict; the user's words never are.
    assert all("<|im_end|>" in t for t in texts) and not any("Again" in t or "Say hi" in t for t in texts)


def test_bad_rows_are_skipped_and_counted(tokenizer):
    rows = [
        CONV,
        {"conversations": [{"from": "human", "value": "only a question"}]},
        {"text": "not a chat"},
        {"messages": [{"role": "user", "content": "x " * 500}, {"role": "assistant", "content": "y"}]},
        {"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "y"}]},
    ]
    stats = RowStats()
    kept = list(tokenize_rows(tokenizer, iter(rows), max_seq_len=256, stats=stats))
    assert [r.sample_id for r in kept] == [0]
    assert stats.kept == 1
    assert stats.skipped == {"no_assistant_turn": 1, "malformed": 2, "too_long": 1}
    assert "1 rows kept, 4 skipped" in stats.summary()


def test_reads_jsonl_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.jsonl").write_text(json.dumps(CONV) + "\n" + json.dumps(CONV) + "\n")
    pq.write_table(pa.Table.from_pylist([{"messages": [{"role": "user", "content": "q"},
                                                       {"role": "assistant", "content": "a"}]}]), tmp_path / "b.parquet")
    assert len(list(read_rows(str(tmp_path)))) == 3
    assert len(list(read_rows(str(tmp_path / "a.jsonl"), max_rows=1))) == 1


def test_missing_dataset_names_the_fix(tmp_path, monkeypatch):
    """Offline asked after the hub libraries were imported (they read it once, at import) is still
    offline: the error says so at once, instead of after the network's retries."""
    import datasets  # noqa: F401 - imported first, as in any process that loaded a dataset before

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="data.sources") as info:
        list(read_rows("no-such-org/no-such-dataset"))
    assert "offline" in str(info.value).lower(), info.value


@pytest.mark.parametrize("content,needle", [
    ('{"messages": []}\n{"messages": [}\n', ":2: not valid JSON"),
    ('{"messages": []}\n\n[1, 2]\n', ":3: a JSON list"),
    ('{"n": ' + "1" * 5000 + "}\n", ":1: not valid JSON"),  # json raises a plain ValueError (no .msg) here
])
def test_a_corrupt_jsonl_line_is_named_with_its_number(tmp_path, content, needle):
    from hpc.data.sources import read_rows
    from hpc.errors import UserError

    path = tmp_path / "rows.jsonl"
    path.write_text(content)
    with pytest.raises(UserError, match=needle) as info:
        list(read_rows(str(path)))
    assert str(path) in str(info.value) and "\n" not in str(info.value)
