"""The grain pipeline: packing invariants, resume, sharding, held-out split, config validation."""

import contextlib
import json
import random

import numpy as np
import pytest

from dflash_jax.data import packing, pipeline, sources
from dflash_jax.data.chat import tokenize_conversation
from dflash_jax.data.pipeline import DataConfig, load_heldout_prompts, make_train_iterator

MAX_LEN = 96
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi pi rho sigma tau".split()


def _text(rng, lo, hi):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def _records(n, seed=0, id_fmt="conv{}"):
    rng = random.Random(seed)
    recs = []
    for i in range(n):
        msgs = [{"role": "system", "content": "Be nice."}] if i % 5 == 0 else []
        for _ in range(rng.randint(1, 3)):
            msgs.append({"role": "user", "content": _text(rng, 1, 12)})
            msgs.append({"role": "assistant", "content": _text(rng, 1, 40)})
        recs.append({"id": id_fmt.format(i), "messages": msgs})
    return recs


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    sources.write_chat_jsonl(path, _records(40))
    return str(path)


def _cfg(path, **kw):
    base = dict(
        sources=[path],
        max_length=MAX_LEN,
        batch_size=4,
        seed=3,
        num_epochs=1,
        enable_thinking=False,
        prefetch=0,
    )
    base.update(kw)
    return DataConfig(**base)


def _all_batches(it):
    with contextlib.closing(it):
        return list(it)


def _doc_key(d):
    return (tuple(np.asarray(d["input_ids"]).tolist()), tuple(np.asarray(d["loss_mask"]).tolist()))


def _expected_docs(tok, cfg, ids=None):
    """Tokenise every training record independently of the pipeline."""
    train, _, _ = pipeline.split_records(cfg)
    src = sources.RecordSource(train)
    out = []
    for i in range(len(src)):
        rec = src[i]
        if ids is not None and rec["id"] not in ids:
            continue
        t, m = tokenize_conversation(tok, rec["messages"], enable_thinking=cfg.enable_thinking)
        d = packing.truncate_document(t, m, cfg.max_length)
        if d["loss_mask"].sum() >= cfg.min_loss_tokens:
            out.append(_doc_key(d))
    return sorted(out)


def test_one_epoch_loses_and_duplicates_nothing(qwen, data_file):
    cfg = _cfg(data_file, prefetch=2, batch_size=5)
    batches = _all_batches(make_train_iterator(cfg, qwen))
    for b in batches:
        assert set(b) == {"input_ids", "positions", "segment_ids", "loss_mask"}
        for v in b.values():
            assert v.shape == (5, MAX_LEN) and v.dtype == np.int32
        # positions restart at 0 at every document start, segments count 1, 2, ... per row
        starts = (b["segment_ids"] > 0) & np.concatenate(
            [np.ones((5, 1), bool), b["segment_ids"][:, 1:] != b["segment_ids"][:, :-1]], axis=1
        )
        assert np.all(b["positions"][starts] == 0)
        assert np.all(b["positions"][(b["segment_ids"] > 0) & ~starts] > 0)
        assert np.all(b["loss_mask"][b["segment_ids"] == 0] == 0)
        assert np.all(b["input_ids"][b["segment_ids"] == 0] == qwen.pad_token_id)
    # the epoch's last batch is short: it is padded with empty rows, not dropped
    assert np.all(batches[-1]["segment_ids"][-1] == 0) and batches[-1]["segment_ids"][0, 0] == 1
    got = sorted(_doc_key(d) for b in batches for d in packing.unpack_documents(b))
    want = _expected_docs(qwen, cfg)
    assert len(want) >= 35 and got == want
    assert any(len(k[0]) == MAX_LEN for k in want)  # some documents were truncated
    # packing actually packs: more documents than rows
    assert sum(int((b["segment_ids"].max(axis=1) > 0).sum()) for b in batches) < len(want)


def test_resume_continues_with_the_next_batch(qwen, data_file):
    cfg = _cfg(data_file, num_epochs=None, prefetch=2, shuffle=True)
    it = make_train_iterator(cfg, qwen)
    with contextlib.closing(it):
        for _ in range(5):
            next(it)
        state = json.loads(json.dumps(it.get_state()))  # what a checkpoint stores
        want = [next(it) for _ in range(12)]  # crosses into the next epoch
    it2 = make_train_iterator(cfg, qwen)
    with contextlib.closing(it2):
        it2.set_state(state)
        got = [next(it2) for _ in range(12)]
    for g, w in zip(got, want, strict=True):
        for k in w:
            np.testing.assert_array_equal(g[k], w[k])


def test_shuffle_is_deterministic_by_seed(qwen, data_file):
    first = lambda **kw: _all_batches(make_train_iterator(_cfg(data_file, **kw), qwen))[0]["input_ids"]
    np.testing.assert_array_equal(first(seed=5), first(seed=5))
    assert not np.array_equal(first(seed=5), first(seed=6))


def test_processes_get_disjoint_shards(qwen, data_file):
    cfg = _cfg(data_file, batch_size=4)
    docs = []
    for p in range(2):
        batches = _all_batches(make_train_iterator(cfg, qwen, process_index=p, process_count=2))
        assert all(b["input_ids"].shape == (2, MAX_LEN) for b in batches)
        docs.append(sorted(_doc_key(d) for b in batches for d in packing.unpack_documents(b)))
    assert docs[0] and docs[1]
    assert sorted(docs[0] + docs[1]) == _expected_docs(qwen, cfg)
    with pytest.raises(ValueError, match="batch_size=4 is not divisible by process_count=3"):
        make_train_iterator(cfg, qwen, process_index=0, process_count=3)


def test_heldout_split_is_disjoint_deterministic_and_grouped(qwen, tmp_path):
    path = tmp_path / "d.jsonl"
    sources.write_chat_jsonl(path, _records(30))
    cfg = _cfg(str(path), heldout_count=6, heldout_seed=11)
    prompts = load_heldout_prompts(cfg)
    assert len(prompts) == 6
    assert prompts == load_heldout_prompts(_cfg(str(path), heldout_count=6, heldout_seed=11, seed=99))
    assert [p["id"] for p in prompts] != [
        p["id"] for p in load_heldout_prompts(_cfg(str(path), heldout_count=6))
    ]
    for p in prompts:
        assert p["messages"][-1]["role"] == "user" and all(m["role"] != "assistant" for m in p["messages"])
        assert p["reference"]
    # the held-out conversations never reach training: not in the split, not in any batch
    held_ids = {p["id"] for p in prompts}
    train, _, report = pipeline.split_records(cfg)
    train_ids = {k.split(":", 1)[1] for k in train.keys}
    assert not held_ids & train_ids and len(train_ids) + 6 == 30
    assert report.heldout_records == 6
    got = sorted(
        _doc_key(d) for b in _all_batches(make_train_iterator(cfg, qwen)) for d in packing.unpack_documents(b)
    )
    all_ids = held_ids | train_ids
    assert got == _expected_docs(qwen, _cfg(str(path)), ids=train_ids)
    assert not set(got) & set(_expected_docs(qwen, _cfg(str(path)), ids=held_ids))
    assert len(all_ids) == 30
    # a fraction holds out roughly that share
    frac = pipeline.split_records(_cfg(str(path), heldout_fraction=0.5))[2]
    assert 5 <= frac.heldout_records <= 25


def test_sharegpt_parts_of_one_chat_are_held_out_together(tmp_path, monkeypatch):
    recs = []
    for i in range(20):
        for part in range(3):
            recs.append(
                {
                    "id": f"chat{i}_{part}",
                    "conversations": [
                        {"from": "human", "value": f"q{i}.{part}"},
                        {"from": "gpt", "value": "a"},
                    ],
                }
            )
    p = tmp_path / "share.json"
    p.write_text(json.dumps(recs))
    monkeypatch.setattr(sources, "sharegpt_json_path", lambda: str(p))
    pipeline._cached_index.cache_clear()
    cfg = DataConfig(sources=["sharegpt"], heldout_count=4)
    train, held, _ = pipeline.split_records(cfg)
    held = held["test"]
    assert len(held) == 4 and all(len(h) == 3 for h in held)
    held_chats = {k.split(":")[1].rsplit("_", 1)[0] for h in held for k in h.keys}
    assert not held_chats & {k.split(":")[1].rsplit("_", 1)[0] for k in train.keys}
    assert [p["id"] for p in load_heldout_prompts(cfg)] == [h.keys[0].split(":")[1] for h in held]
    pipeline._cached_index.cache_clear()


def test_bad_records_skip_or_fail_through_the_pipeline(qwen, tmp_path):
    p = tmp_path / "mixed.jsonl"
    good = _records(6)
    lines = [json.dumps(r) for r in good]
    lines.insert(2, '{"id": "broken", ')
    lines.insert(4, json.dumps({"id": "q", "messages": [{"role": "user", "content": "only a question"}]}))
    p.write_text("\n".join(lines) + "\n")
    cfg = _cfg(str(p), max_skip_fraction=0.5)  # 2 of 8 bad: above the default limit of 10%
    ds, report = pipeline.build_train_dataset(cfg, qwen)
    assert report.load.skipped == {"malformed_json": 1, "no_assistant": 1} and report.train_records == 6
    assert "skipped bad records: 2" in report.summary()
    assert len(sorted(_doc_key(d) for b in _all_batches(iter(ds)) for d in packing.unpack_documents(b))) == 6
    with pytest.raises(sources.BadRecordError, match=rf"{p}:3: malformed JSON"):
        make_train_iterator(_cfg(str(p), on_bad_record="fail"), qwen)


def test_template_failures_follow_on_bad_record(qwen, data_file):
    hiding = (
        "{% for m in messages %}<|im_start|>{{ m.role }}{{ '\\n' }}{% if m.role == 'assistant' and 'alpha' in m.content %}"
        "[redacted]{% else %}{{ m.content }}{% endif %}<|im_end|>{{ '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}"
    )
    cfg = _cfg(data_file, chat_template=hiding, shuffle=False)
    n_docs = sum(len(packing.unpack_documents(b)) for b in _all_batches(make_train_iterator(cfg, qwen)))
    assert 0 < n_docs < 40
    it = make_train_iterator(_cfg(data_file, chat_template=hiding, shuffle=False, on_bad_record="fail"), qwen)
    with (
        contextlib.closing(it),
        pytest.raises(sources.BadRecordError, match=rf"{data_file}:\d+: .*does not render"),
    ):
        list(it)


def test_sharegpt_demo_batches(qwen):
    cfg = DataConfig(
        sources=["sharegpt"],
        max_records=40,
        max_length=256,
        batch_size=2,
        enable_thinking=False,
        heldout_count=4,
    )
    it = make_train_iterator(cfg, qwen)
    with contextlib.closing(it):
        batches = [next(it) for _ in range(4)]
    for b in batches:
        assert b["input_ids"].shape == (2, 256)
        assert b["loss_mask"].sum() > 0 and (b["segment_ids"] > 0).mean() > 0.5
    text = qwen.decode(batches[0]["input_ids"][0][batches[0]["segment_ids"][0] > 0].tolist())
    assert "<|im_start|>user\n" in text


def test_dataconfig_validation():
    with pytest.raises(ValueError, match=r"unknown keys \['batchsize'\]"):
        DataConfig.from_dict({"sources": ["x"], "batchsize": 3})
    for field, value in [
        ("max_length", 0),
        ("batch_size", -1),
        ("num_epochs", 0),
        ("on_bad_record", "ignore"),
        ("heldout_fraction", 1.0),
        ("enable_thinking", "yes"),
        ("seed", 2**32),
        ("shuffle", 1),
        ("sources", []),
    ]:
        with pytest.raises(ValueError, match=f"DataConfig.{field}"):
            DataConfig(**{field: value})
    with pytest.raises(ValueError, match="not both"):
        DataConfig(heldout_fraction=0.1, heldout_count=3)
    cfg = DataConfig.from_dict({"sources": "sharegpt", "num_epochs": None})
    assert cfg.sources == ("sharegpt",) and cfg.rows_per_process(2) == 4


@pytest.mark.slow
def test_worker_processes_match_and_resume(qwen, data_file):
    """Tokenising in worker processes gives a deterministic, resumable stream (spawns processes)."""
    cfg = _cfg(data_file, num_workers=2, prefetch=2)
    batches = _all_batches(make_train_iterator(cfg, qwen))
    got = sorted(_doc_key(d) for b in batches for d in packing.unpack_documents(b))
    assert got == _expected_docs(qwen, cfg)
    it = make_train_iterator(cfg, qwen)
    with contextlib.closing(it):
        next(it)
        state = json.loads(json.dumps(it.get_state()))
        want = next(it)
    it2 = make_train_iterator(cfg, qwen)
    with contextlib.closing(it2):
        it2.set_state(state)
        got = next(it2)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


def test_reader_threads_give_the_same_stream(qwen, data_file):
    one = _all_batches(make_train_iterator(_cfg(data_file, read_threads=1), qwen))
    four = _all_batches(make_train_iterator(_cfg(data_file, read_threads=4), qwen))
    assert len(one) == len(four)
    for a, b in zip(one, four, strict=True):
        np.testing.assert_array_equal(a["input_ids"], b["input_ids"])


def test_to_global_batch_shards_rows_over_devices(qwen, data_file):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    batch = next(iter(make_train_iterator(_cfg(data_file, batch_size=8), qwen)))
    out = pipeline.to_global_batch(batch, NamedSharding(mesh, PartitionSpec("data")))
    assert out["input_ids"].shape == (8, MAX_LEN) and len(out["input_ids"].addressable_shards) == 8
    assert out["loss_mask"].addressable_shards[3].data.shape == (1, MAX_LEN)
    np.testing.assert_array_equal(np.asarray(out["segment_ids"]), batch["segment_ids"])
