"""The inputs users hold: parquet files, save_to_disk directories, pre-tokenized rows, tool calls and
content parts; each read, trained the way the loss mask says, and its bad record named by file and
row (tables) or line (JSON)."""

import json
import logging
import pickle

import datasets
import numpy as np
import pytest
from fixtures import hf_ids, masked_runs, read_all_records

from dflash_jax.data import pipeline, sources
from dflash_jax.data.chat import tokenize_conversation
from dflash_jax.data.sources import BadDataError, BadRecordError, RecordSource, index_sources


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    # Dataset.from_parquet converts into the datasets cache: keep it out of ~/.cache.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    sources._TABLES.clear()


def _chat(i, reply=None):
    return {
        "id": f"r{i}",
        "messages": [
            {"role": "user", "content": f"question {i}?"},
            {"role": "assistant", "content": reply or f"answer {i}."},
        ],
    }


def _bad_role(i):
    rec = _chat(i)
    rec["messages"][0]["role"] = "robot"
    return rec


def _bad_record_is_named(path, origin, reason, message):
    """fail: raised naming ``origin``; skip: counted, its first origin kept, refused above the limit."""
    with pytest.raises(BadRecordError, match=rf"^{origin}: .*{message}") as exc:
        index_sources([str(path)], on_bad_record="fail")
    assert exc.value.reason == reason and exc.value.origin == origin
    index, report = index_sources([str(path)], on_bad_record="skip")
    assert report.skipped == {reason: 1} and report.sources[0].first_skipped == {reason: origin}
    sources.check_skip_fraction(report, 0.5)  # 1 bad record of 4: under the limit
    with pytest.raises(BadDataError, match=rf"{reason}: 1 \(first at {origin}\)"):
        sources.check_skip_fraction(report, 0.1)
    return index


# --------------------------------------------------------------------------- parquet


def test_parquet_file_is_read_row_by_row_and_names_the_bad_row(tmp_path):
    recs = [_chat(0), _chat(1), _bad_role(2), _chat(3)]
    p = tmp_path / "chats.parquet"
    datasets.Dataset.from_list(recs).to_parquet(str(p))
    index = _bad_record_is_named(p, f"{p}:row 2", "unknown_role", "unknown role 'robot'")
    got = read_all_records(index)
    assert [(r["id"], r["messages"]) for r in got] == [
        (r["id"], r["messages"]) for r in (recs[0], recs[1], recs[3])
    ]
    assert got[2]["origin"] == f"{p}:row 3"


def test_parquet_without_ids_gets_row_ids(tmp_path):
    p = tmp_path / "noid.parquet"
    datasets.Dataset.from_list([{"messages": _chat(i)["messages"]} for i in range(3)]).to_parquet(str(p))
    index, _ = index_sources([str(p)], on_bad_record="fail")
    assert index.keys == tuple(f"noid.parquet:noid.parquet:row{r}" for r in range(3))


# --------------------------------------------------------------------------- save_to_disk


def test_save_to_disk_directory_through_the_pipeline(tmp_path):
    recs = [_chat(0), _chat(1), _chat(2), _bad_role(3)]
    d = tmp_path / "saved"
    datasets.Dataset.from_list(recs).save_to_disk(str(d))
    index = _bad_record_is_named(d, f"{d}:row 3", "unknown_role", "unknown role 'robot'")
    assert [r["id"] for r in read_all_records(index)] == ["r0", "r1", "r2"]

    # a grain worker gets a pickled source and opens the table itself
    src = pickle.loads(pickle.dumps(RecordSource(index)))
    sources._TABLES.clear()
    assert src[1]["messages"] == recs[1]["messages"] and src[1]["origin"] == f"{d}:row 1"

    # the pipeline's cache stamp and the feature cache's fingerprint cover a directory's files
    cfg = pipeline.DataConfig(sources=(str(d),), on_bad_record="skip", max_skip_fraction=0.5)
    idx, _ = pipeline.load_index(cfg)
    assert len(idx) == 3
    from dflash_jax.training.feature_cache import data_fingerprint

    assert data_fingerprint(cfg)["sources"][0].startswith("saved:")


def test_save_to_disk_splits_and_plain_directories(tmp_path):
    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list([_chat(0), _chat(1)]),
            "test": datasets.Dataset.from_list([_chat(2)]),
        }
    )
    d = tmp_path / "dict"
    dd.save_to_disk(str(d))
    index, _ = index_sources([str(d)])
    assert [r["id"] for r in read_all_records(index)] == ["r0", "r1"]  # the train split
    index, _ = index_sources([str(d / "test")])
    assert [r["id"] for r in read_all_records(index)] == ["r2"]
    del dd["train"]
    dd["validation"] = datasets.Dataset.from_list([_chat(3)])
    d2 = tmp_path / "no-train"
    dd.save_to_disk(str(d2))
    with pytest.raises(ValueError, match=r"holds the splits \['test', 'validation'\]: name one"):
        index_sources([str(d2)])
    (tmp_path / "plain").mkdir()
    with pytest.raises(IsADirectoryError, match="not a datasets save_to_disk one"):
        sources.resolve_source(str(tmp_path / "plain"))


def test_hf_name_not_in_the_local_cache_is_a_clear_error():
    with pytest.raises(
        FileNotFoundError, match="not readable from the local Hugging Face cache.*nothing is downloaded"
    ):
        index_sources(["hf:someone/not-cached-anywhere:train"])
    with pytest.raises(ValueError, match="expected hf:NAME"):
        sources.resolve_source("hf:")


# --------------------------------------------------------------------------- pre-tokenized rows


def test_pre_tokenized_rows_are_trained_as_they_are(qwen, tmp_path, caplog):
    vocab = len(qwen)
    rows = [
        {"id": "t0", "input_ids": [10, 11, 12, 13, 14], "loss_mask": [0, 0, 1, 1, 1]},
        {"id": "t1", "input_ids": [20, 21, 22], "loss_mask": [0, 1, 1]},
        {"id": "t2", "input_ids": [30, 31, 32, 33], "loss_mask": [0, 0, 1]},  # bad: lengths differ
        {"id": "t3", "input_ids": [40, vocab, 42], "loss_mask": [0, 1, 1]},  # another model's ids
    ]
    d = tmp_path / "tokens"
    datasets.Dataset.from_list(rows).with_format("numpy").save_to_disk(str(d))  # saved with its format
    index = _bad_record_is_named(d, f"{d}:row 2", "bad_tokens", "'input_ids' has 4 tokens but 'loss_mask' 3")
    recs = read_all_records(index)
    assert [(r["input_ids"], r["loss_mask"]) for r in recs] == [
        (rows[i]["input_ids"], rows[i]["loss_mask"]) for i in (0, 1, 3)
    ]

    cfg = pipeline.DataConfig(sources=(str(d),), on_bad_record="fail", max_length=4)
    tok = pipeline.TokenizeRecord(qwen, cfg)
    doc = tok(recs[0])
    np.testing.assert_array_equal(doc["input_ids"], [10, 11, 12, 13])  # no re-tokenisation; truncated
    np.testing.assert_array_equal(doc["loss_mask"], [0, 0, 1, 1])
    with pytest.raises(BadRecordError, match=rf"^{d}:row 3: token id {vocab} >= the tokenizer's vocabulary"):
        tok(recs[2])
    skip = pipeline.TokenizeRecord(qwen, pipeline.DataConfig(sources=(str(d),)))
    with caplog.at_level(logging.WARNING):
        assert skip(recs[2]) is None
    assert skip.dropped == {"token_ids": 1} and f"{d}:row 3" in caplog.text


def test_pre_tokenized_jsonl_through_the_pipeline(qwen, tmp_path):
    p = tmp_path / "tokens.jsonl"
    rows = [
        {"id": f"t{i}", "input_ids": list(range(100 * i + 1, 100 * i + 6)), "loss_mask": [0, 0, 1, 1, 1]}
        for i in range(4)
    ]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = pipeline.DataConfig(
        sources=(str(p),), max_length=16, batch_size=2, num_epochs=1, shuffle=False, on_bad_record="fail"
    )
    docs = []
    for batch in pipeline.make_train_iterator(cfg, qwen):
        for ids, seg, mask in zip(batch["input_ids"], batch["segment_ids"], batch["loss_mask"], strict=True):
            for s in sorted(set(seg.tolist()) - {0}):
                docs.append((ids[seg == s].tolist(), mask[seg == s].tolist()))
    assert sorted(docs) == sorted((r["input_ids"], r["loss_mask"]) for r in rows)
    assert pipeline.load_heldout_prompts(cfg) == []  # no conversation to prompt with


# --------------------------------------------------------------------------- tool calls

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp_c": 21}'},
    {"role": "assistant", "content": "It is 21 °C in Paris."},
]


def test_tool_calls_reach_the_template_and_train_the_calls(qwen, tmp_path):
    p = tmp_path / "tools.jsonl"
    bad = {
        "id": "x",
        "tools": TOOLS,
        "messages": [TOOL_CHAT[0], {**TOOL_CHAT[1], "tool_calls": [{"type": "function"}]}],
    }
    lines = [{"id": f"g{i}", "tools": TOOLS, "messages": TOOL_CHAT} for i in range(3)]
    lines.insert(1, bad)  # line 2
    p.write_text("".join(json.dumps(r) + "\n" for r in lines))
    index = _bad_record_is_named(p, f"{p}:2", "bad_tool_calls", r"tool_calls\[0\] has no 'function'")
    rec = read_all_records(index)[0]
    assert rec["tools"] == TOOLS
    assert [m["role"] for m in rec["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert rec["messages"][1]["content"] == "" and rec["messages"][2]["tool_call_id"] == "c1"

    ids, mask = tokenize_conversation(qwen, rec["messages"], tools=rec["tools"], enable_thinking=False)
    assert ids.tolist() == hf_ids(qwen, rec["messages"], tools=TOOLS, enable_thinking=False)
    assert "get_weather" in qwen.decode(ids[: int(np.argmax(mask))])  # the tool schema is in the prompt
    assert masked_runs(qwen, ids, mask) == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        "It is 21 °C in Paris.<|im_end|>",
    ]  # the tool result and the prompts are never trained


def test_tool_calls_from_a_parquet_table(qwen, tmp_path):
    # As tables store them: tools as a JSON string, arguments as a string, every turn with every field.
    msgs = [dict(m) for m in TOOL_CHAT]
    msgs[1] = {
        **msgs[1],
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    }
    rows = [{"id": f"g{i}", "tools": json.dumps(TOOLS), "messages": msgs} for i in range(3)]
    rows.append({"id": "x", "tools": "{oops", "messages": msgs})
    p = tmp_path / "tools.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(p))
    index = _bad_record_is_named(p, f"{p}:row 3", "bad_tools", "'tools' is a string but not JSON")
    rec = read_all_records(index)[0]
    assert rec["tools"] == TOOLS and "tool_calls" not in rec["messages"][0]
    ids, mask = tokenize_conversation(qwen, rec["messages"], tools=rec["tools"], enable_thinking=False)
    runs = masked_runs(qwen, ids, mask)
    assert runs[0].startswith("<tool_call>") and '"city": "Paris"' in runs[0] and len(runs) == 2


# --------------------------------------------------------------------------- content parts


def test_content_parts_are_joined(qwen, tmp_path):
    parts = {
        "id": "p",
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "Be terse."}]},
            {"role": "user", "content": [{"type": "text", "text": "2+2"}, {"type": "text", "text": "?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "4"}]},
        ],
    }
    image = {
        "id": "i",
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a.png"}}]},
            {"role": "assistant", "content": "a cat"},
        ],
    }
    p = tmp_path / "parts.json"  # a JSON array, one element per line: element k on line k + 2
    p.write_text("[\n" + ",\n".join(json.dumps(r) for r in (parts, image, parts, parts)) + "\n]\n")
    origin = f"{p}:3"
    index = _bad_record_is_named(p, origin, "non_text_content", "content part 0 is 'image_url'")
    rec = read_all_records(index)[0]
    joined = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    assert rec["messages"] == joined
    ids, mask = tokenize_conversation(qwen, rec["messages"], enable_thinking=False)
    assert ids.tolist() == hf_ids(qwen, joined, enable_thinking=False)
    assert masked_runs(qwen, ids, mask) == ["4<|im_end|>"]


def test_written_chat_files_keep_tool_calls(tmp_path):
    p = tmp_path / "out.jsonl"
    sources.write_chat_jsonl(p, [{"id": "g", "tools": TOOLS, "messages": TOOL_CHAT}])
    back = sources.read_chat_jsonl(p)
    assert back[0]["tools"] == TOOLS
    assert back[0]["messages"][1]["tool_calls"] == TOOL_CHAT[1]["tool_calls"]
    assert back[0]["messages"][2] == {"role": "tool", "content": '{"temp_c": 21}', "tool_call_id": "c1"}


def test_pre_tokenized_rows_are_not_regenerated(qwen):
    from dflash_jax.decoding.regeneration import dataset_replies

    row = {"id": "t", "input_ids": [1, 2], "loss_mask": [0, 1], "origin": "tokens.jsonl:1"}
    with pytest.raises(BadDataError, match="^tokens.jsonl:1: a pre-tokenized row has no conversation"):
        dataset_replies(qwen, [row])


def test_json_and_table_sources_together(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text("".join(json.dumps(_chat(i)) + "\n" for i in range(2)))
    q = tmp_path / "b.parquet"
    datasets.Dataset.from_list([_chat(i) for i in range(2, 5)]).to_parquet(str(q))
    index, report = index_sources([str(p), str(q)], max_records=4)
    assert [r["origin"] for r in read_all_records(index)] == [f"{p}:1", f"{p}:2", f"{q}:row 0", f"{q}:row 1"]
    assert [s.records_kept for s in report.sources] == [2, 2] and report.sources[1].stopped_at_max_records
