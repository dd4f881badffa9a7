"""Chat-data sources: streaming JSON arrays (truncated files), JSONL, bad records, ShareGPT V3."""

import json
import logging

import pytest
from fixtures import read_all_records

from dflash_jax.data import sources
from dflash_jax.data.sources import BadRecordError, RecordSource, index_sources

GOOD = [
    {
        "id": "a",
        "conversations": [
            {"from": "human", "value": "Hi ünïcödé ✓ 你好"},
            {"from": "gpt", "value": "Hello!"},
        ],
    },
    {
        "id": "b",
        "messages": [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "and 3+3?"},
        ],
    },
    {
        "id": "c",
        "conversations": [{"from": "user", "value": "x" * 300}, {"from": "chatgpt", "value": "y\n" * 50}],
    },
    {"conversations": [{"from": "human", "value": "no id"}, {"from": "bard", "value": "fine"}]},
]


def _write_array(path, records, *, cut_bytes=0):
    text = json.dumps(records, indent=2, ensure_ascii=False).encode("utf-8")
    path.write_bytes(text[: len(text) - cut_bytes] if cut_bytes else text)
    return text


def test_normalisation_maps_speakers_and_trims_trailing_user(tmp_path):
    p = tmp_path / "chats.json"
    _write_array(p, GOOD)
    index, report = index_sources([str(p)], on_bad_record="fail")
    recs = read_all_records(index)
    assert [r["id"] for r in recs] == ["a", "b", "c", "chats.json:" + str(index.line[3])]
    assert recs[0]["messages"] == [
        {"role": "user", "content": "Hi ünïcödé ✓ 你好"},
        {"role": "assistant", "content": "Hello!"},
    ]
    # the trailing user turn of "b" adds nothing to train on
    assert [m["role"] for m in recs[1]["messages"]] == ["system", "user", "assistant"]
    assert recs[2]["messages"][1]["role"] == "assistant"  # chatgpt
    assert recs[3]["messages"][1]["role"] == "assistant"  # bard
    assert report.records_kept == 4 and report.num_skipped == 0
    assert report.sources[0].truncation_detail is None


@pytest.mark.parametrize("chunk_bytes", [5, 64, 1 << 22])
def test_truncated_json_array_keeps_complete_records(tmp_path, chunk_bytes):
    recs = GOOD * 5
    p = tmp_path / "cut.json"
    full = _write_array(p, recs, cut_bytes=40)  # cut inside the last element's string
    with pytest.raises(json.JSONDecodeError):
        json.loads(p.read_bytes())  # what a json.load-based loader would hit
    data = p.read_bytes()
    raw = []
    with pytest.raises(sources._TruncatedTail) as exc:
        for item in sources._iter_json_array(str(p), chunk_bytes=chunk_bytes):
            raw.append(item)
    assert len(raw) == len(recs) - 1
    for (obj, b0, b1, line), want in zip(raw, recs, strict=False):
        assert obj == want
        assert json.loads(data[b0:b1]) == want  # byte ranges are exact (multi-byte chars included)
        assert data[:b0].count(b"\n") + 1 == line
    last_start = full.rfind(b"\n  {")
    assert exc.value.line == full[: last_start + 1].count(b"\n") + 1
    assert exc.value.nbytes == len(data) - (last_start + 3)


def test_truncated_array_is_reported_not_fatal(tmp_path, caplog):
    p = tmp_path / "cut.json"
    _write_array(p, GOOD * 3, cut_bytes=25)
    with caplog.at_level(logging.WARNING):
        index, report = index_sources([str(p)], on_bad_record="fail")
    rep = report.sources[0]
    assert len(index) == rep.records_kept == rep.records_read == len(GOOD) * 3 - 1
    assert rep.truncated_tail_bytes > 0 and rep.truncated_at_line is not None
    assert "truncated" in rep.summary() and "truncated" in caplog.text


def test_malformed_element_mid_array(tmp_path):
    p = tmp_path / "bad.json"
    text = json.dumps(GOOD, indent=2).replace('"Hello!"', '"Hello!" oops', 1)
    p.write_text(text)
    with pytest.raises(BadRecordError, match=rf"{p}:2: malformed JSON"):
        index_sources([str(p)], on_bad_record="fail")
    index, report = index_sources([str(p)], on_bad_record="skip")
    rep = report.sources[0]
    assert len(index) == 0 and rep.skipped == {"malformed_json": 1}
    assert rep.truncated_tail_bytes > 0 and "malformed element at line 2" in rep.summary()


_BAD_LINES = {
    "malformed_json": ('{"id": "m", "messages": [', "malformed JSON line"),
    "no_assistant": (
        json.dumps(
            {"id": "n", "messages": [{"role": "user", "content": "q"}, {"role": "user", "content": "q2"}]}
        ),
        "no assistant turn",
    ),
    "empty_content": (
        json.dumps(
            {"id": "e", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " "}]}
        ),
        "content is empty",
    ),
    "non_string_content": (
        json.dumps(
            {
                "id": "s",
                "messages": [
                    {"role": "user", "content": {"text": "q"}},
                    {"role": "assistant", "content": "a"},
                ],
            }
        ),
        "content is dict, expected a string or a list of text parts",
    ),
    "non_text_content": (
        json.dumps(
            {
                "id": "p",
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]},
                    {"role": "assistant", "content": "a"},
                ],
            }
        ),
        "content part 0 is 'image_url'",
    ),
    "unknown_role": (
        json.dumps(
            {
                "id": "u",
                "messages": [{"role": "robot", "content": "{}"}, {"role": "assistant", "content": "a"}],
            }
        ),
        "unknown role 'robot'",
    ),
    "bad_tool_calls": (
        json.dumps(
            {
                "id": "c",
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]},
                ],
            }
        ),
        r"tool_calls\[0\] has no 'function' with a 'name'",
    ),
    "bad_tools": (
        json.dumps(
            {
                "id": "t",
                "tools": "{not json",
                "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            }
        ),
        "'tools' is a string but not JSON",
    ),
    "bad_tokens": (json.dumps({"id": "k", "input_ids": [1, 2, 3], "loss_mask": [0, 1]}), "must match"),
    "empty_conversation": (json.dumps({"id": "z", "conversations": []}), "'conversations' is empty"),
}


@pytest.mark.parametrize("reason", sorted(_BAD_LINES))
def test_bad_record_names_file_and_line(tmp_path, reason, caplog):
    line, msg = _BAD_LINES[reason]
    good = json.dumps(
        {"id": "g", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    )
    p = tmp_path / "data.jsonl"
    p.write_text("\n".join([good, "", good, line, good]) + "\n")  # bad record on line 4
    with pytest.raises(BadRecordError, match=rf"^{p}:4: .*{msg}") as exc:
        index_sources([str(p)], on_bad_record="fail")
    assert exc.value.reason == reason
    with caplog.at_level(logging.WARNING):
        index, report = index_sources([str(p)], on_bad_record="skip")
    assert len(index) == 3
    assert report.skipped == {reason: 1} and report.num_skipped == 1
    assert f"{p}:4" in caplog.text and "skipped 1" in report.summary()


def test_on_bad_record_is_validated(tmp_path):
    with pytest.raises(ValueError, match="on_bad_record"):
        index_sources(["sharegpt"], on_bad_record="ignore")


def test_max_records_stops_reading(tmp_path):
    p = tmp_path / "d.jsonl"
    sources.write_chat_jsonl(p, [{"id": str(i), "messages": GOOD[1]["messages"][:3]} for i in range(10)])
    q = tmp_path / "e.jsonl"
    sources.write_chat_jsonl(q, [{"id": str(i), "messages": GOOD[1]["messages"][:3]} for i in range(10)])
    index, report = index_sources([str(p), str(q)], max_records=4)
    assert len(index) == 4 and report.sources[0].stopped_at_max_records and len(report.sources) == 1


def test_write_and_read_chat_jsonl_roundtrip(tmp_path):
    recs = [
        {"id": "r1", "messages": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."}]},
        {
            "id": "r2",
            "messages": [
                {"role": "system", "content": "S"},
                {"role": "user", "content": "Q2 ✓"},
                {"role": "assistant", "content": "<think>\nhm\n</think>\n\nA2"},
            ],
            "meta": {"generator": "target", "temperature": 0.0},
        },
    ]
    p = tmp_path / "sub" / "regen.jsonl"
    assert sources.write_chat_jsonl(p, recs) == 2
    lines = p.read_text(encoding="utf-8").splitlines()
    assert json.loads(lines[1])["meta"] == {"generator": "target", "temperature": 0.0}
    back = sources.read_chat_jsonl(p)
    assert [(r["id"], r["messages"]) for r in back] == [(r["id"], r["messages"]) for r in recs]
    with pytest.raises(BadRecordError, match="record #1.*unknown role"):
        sources.write_chat_jsonl(
            tmp_path / "x.jsonl", [{"id": "x", "messages": [{"role": "robot", "content": "?"}]}]
        )
    assert not (tmp_path / "x.jsonl").exists()  # nothing half-written


def test_prompt_messages_stop_before_first_reply():
    msgs = GOOD[1]["messages"]
    assert sources.prompt_messages(msgs) == msgs[:2]


def test_packaged_sharegpt_is_streamed_completely():
    """The real file: one truncated JSON array; every complete record is read (about 1 s)."""
    path = sources.sharegpt_json_path()
    speakers, n_empty, n = set(), 0, 0
    with pytest.raises(sources._TruncatedTail):
        for obj, _, _, _ in sources._iter_json_array(path):
            n += 1
            n_empty += not obj["conversations"]
            speakers.update(t["from"] for t in obj["conversations"])
    assert n == 17671 and n_empty == 126
    assert speakers == {"human", "gpt", "system", "chatgpt", "bing", "bard", "user"}
    assert speakers <= set(sources.ROLE_ALIASES)

    index, report = index_sources([sources.SHAREGPT], on_bad_record="skip")
    rep = report.sources[0]
    assert rep.records_read == 17671 and rep.skipped["empty_conversation"] == 126
    assert rep.records_kept + rep.num_skipped == 17671 == len(index) + report.num_skipped
    assert rep.truncated_tail_bytes > 0
    # ShareGPT splits long chats into X_0, X_1, ...: those share a held-out group
    i = index.keys.index("sharegpt:QWJhYvA_0")
    assert index.groups[i] == "sharegpt:QWJhYvA"
    rec = RecordSource(index)[i]
    assert rec["id"] == "QWJhYvA_0" and rec["messages"][0]["role"] == "user"
    assert rec["messages"][0]["content"].startswith("Summarize the main ideas of Jeff Walker")


def test_invalid_utf8_names_file_and_byte(tmp_path):
    p = tmp_path / "bin.json"
    data = b'[{"id": "a", "messages": [{"role": "user", "content": "\xff\xfe"}]}]'
    p.write_bytes(data)
    with pytest.raises(ValueError, match=rf"{p}: not valid UTF-8 near byte {data.index(0xFF)}$"):
        index_sources([str(p)])
