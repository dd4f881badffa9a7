"""The held-out splits: test and validation disjoint from each other and from training, duplicated
first user turns removed, what appending data moves, and the config that sets them."""

import random

import pytest

from dflash_jax.config_io import ConfigError
from dflash_jax.data import pipeline, sources, splits
from dflash_jax.data.pipeline import DataConfig, load_heldout_prompts

SIDES = ("test", "validation", "train")


def _conversation(rid, prompt, rng):
    reply = " ".join(rng.choice("a b c d e f".split()) for _ in range(rng.randint(1, 6)))
    return {
        "id": rid,
        "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}],
    }


def _variant(text, k):
    """The same prompt as a user might retype it: case and whitespace change, nothing else."""
    return [text, f"  {text.upper()}  ", text.replace(" ", " \n\t ")][k % 3]


def _dataset(n_unique=40, n_pairs=20, seed=0, prefix="c"):
    """``n_unique`` conversations with their own first user turn and ``n_pairs`` pairs of two
    whose first user turns differ only in case and whitespace, shuffled."""
    rng = random.Random(seed)
    recs = [
        _conversation(f"{prefix}u{i}", f"question {prefix} {i} about topic {i % 7}", rng)
        for i in range(n_unique)
    ]
    for i in range(n_pairs):
        text = f"asked twice {prefix} {i} please"
        recs += [
            _conversation(f"{prefix}p{i}a", _variant(text, i), rng),
            _conversation(f"{prefix}p{i}b", _variant(text, i + 1), rng),
        ]
    rng.shuffle(recs)
    return recs


def _normal(text):  # the comparison the split promises, written out independently
    return " ".join(text.lower().split())


def _sides(cfg):
    """record id -> side, and record id -> normalised first user turn, from the pipeline's split."""
    train, held, report = pipeline.split_records(cfg)
    side = {}
    for name, parts in (("test", held["test"]), ("validation", held["validation"]), ("train", [train])):
        for part in parts:
            for key in part.keys:
                assert key not in side, f"{key} is in two splits"
                side[key.split(":", 1)[1]] = name
    return side, report


@pytest.mark.parametrize(
    "split_fields",
    [{"heldout_count": 12, "validation_count": 12}, {"heldout_fraction": 0.2, "validation_fraction": 0.25}],
)
def test_validation_and_test_are_disjoint_and_share_no_first_user_turn_with_training(tmp_path, split_fields):
    recs = _dataset()
    path = tmp_path / "chats.jsonl"
    sources.write_chat_jsonl(path, recs)
    cfg = DataConfig(sources=[str(path)], heldout_seed=3, **split_fields)
    side, report = _sides(cfg)
    prompt = {r["id"]: _normal(r["messages"][0]["content"]) for r in recs}
    by_side = {name: {prompt[i] for i, s in side.items() if s == name} for name in SIDES}
    assert by_side["test"] and by_side["validation"]
    assert not by_side["test"] & by_side["train"]
    assert not by_side["validation"] & by_side["train"]
    assert not by_side["test"] & by_side["validation"]
    # one conversation per prompt on each held-out side: no prompt counted twice in a mean
    for name in ("test", "validation"):
        assert len(by_side[name]) == sum(s == name for s in side.values())
    # what was removed is exactly the held-out conversations with a duplicate elsewhere: neither
    # trained on nor evaluated
    removed = {r["id"] for r in recs} - set(side)
    assert removed and all(sum(prompt[j] == prompt[i] for j in prompt) == 2 for i in removed)
    assert sum(report.duplicates_removed.values()) == len(removed)
    assert report.heldout_groups == sum(s == "test" for s in side.values())
    assert report.validation_groups == sum(s == "validation" for s in side.values())
    assert "duplicates another split's" in report.summary()
    # every duplicate pair left with one side only: where one twin trains, the other is not held out
    for i, s in side.items():
        if s != "train":
            assert all(side.get(j) != "train" for j in prompt if j != i and prompt[j] == prompt[i])
    if "heldout_count" in split_fields:  # the counts are before removal
        assert report.heldout_groups + report.duplicates_removed["test"] == 12
        assert report.validation_groups + report.duplicates_removed["validation"] == 12


def test_prompts_come_from_their_own_split(tmp_path):
    path = tmp_path / "chats.jsonl"
    sources.write_chat_jsonl(path, _dataset(n_pairs=0))
    cfg = DataConfig(sources=[str(path)], heldout_count=5, validation_count=7)
    side, _ = _sides(cfg)
    test = load_heldout_prompts(cfg)
    val = load_heldout_prompts(cfg, split="validation")
    assert len(test) == 5 and len(val) == 7
    assert {side[p["id"]] for p in test} == {"test"} and {side[p["id"]] for p in val} == {"validation"}
    # the test set does not depend on whether a validation set is held out beside it
    assert load_heldout_prompts(DataConfig(sources=[str(path)], heldout_count=5)) == test
    with pytest.raises(ValueError, match="unknown held-out split 'train'"):
        load_heldout_prompts(cfg, split="train")


def test_appending_data_moves_no_conversation_in_fraction_mode_and_only_down_in_count_mode(tmp_path):
    old = _dataset(n_pairs=0, seed=1, prefix="old")
    new = _dataset(n_unique=120, n_pairs=0, seed=2, prefix="new")
    path = tmp_path / "chats.jsonl"

    def sides(recs, **split_fields):
        sources.write_chat_jsonl(path, recs)  # the same file, grown
        pipeline._cached_index.cache_clear()
        return _sides(DataConfig(sources=[str(path)], heldout_seed=5, **split_fields))[0]

    fractions = dict(heldout_fraction=0.15, validation_fraction=0.15)
    before, after = sides(old, **fractions), sides(old + new, **fractions)
    assert {i: after[i] for i in before} == before
    assert len(set(before.values())) == 3  # the data reaches every side
    # data.max_records reads a prefix: a larger one is appended data too
    assert _sides(DataConfig(sources=[str(path)], heldout_seed=5, max_records=40, **fractions))[0] == before

    counts = dict(heldout_count=6, validation_count=6)
    before, after = sides(old, **counts), sides(old + new, **counts)
    moved = {i for i in before if after[i] != before[i]}
    assert moved  # exact counts over more data: some conversations make room
    assert all(SIDES.index(after[i]) > SIDES.index(before[i]) for i in moved)  # down the ranking only
    pipeline._cached_index.cache_clear()


def test_normalised_prompt_and_its_key():
    assert splits.normalized_prompt("  Hello \n\t WORLD ") == "hello world"
    assert splits.prompt_key("Hello   world") == splits.prompt_key("HELLO WORLD\n")
    assert splits.prompt_key("Hello world") != splits.prompt_key("Hello, world")
    assert splits.prompt_key(None) == splits.NO_PROMPT != splits.prompt_key("x")
    # the German sharp s casefolds to "ss" (lower() would keep it)
    assert splits.prompt_key("STRASSE") == splits.prompt_key("straße")


def test_split_config_errors_name_the_fields():
    for field, value in [
        ("validation_count", -1),
        ("validation_fraction", 1.0),
        ("validation_fraction", -0.1),
    ]:
        with pytest.raises(ValueError, match=f"DataConfig.{field}"):
            DataConfig(**{field: value})
    with pytest.raises(ValueError, match="validation_fraction or validation_count, not both"):
        DataConfig(validation_fraction=0.1, validation_count=3)
    with pytest.raises(ValueError, match="heldout_count=8, validation_count=None with .*both counts or both"):
        DataConfig(heldout_count=8, validation_fraction=0.1)
    with pytest.raises(ValueError, match="validation_count=8 with heldout_fraction=0.1"):
        DataConfig(heldout_fraction=0.1, validation_count=8)
    with pytest.raises(ValueError, match=r"heldout_fraction \+ DataConfig.validation_fraction must be < 1"):
        DataConfig(heldout_fraction=0.5, validation_fraction=0.5)
    with pytest.raises(ValueError, match=r"heldout_count=3 \+ validation_count=4 .* only 5 conversations"):
        splits.heldout_groups([f"g{i}" for i in range(5)], seed=0, test_count=3, validation_count=4)
    with pytest.raises(ConfigError, match="data.validation_count"):
        from dflash_jax.training.run_config import load_run_config

        load_run_config("tiny", ["data.validation_count=many"])
    with pytest.raises(ValueError, match="eval.validation_prompts must be >= 0"):
        load_run_config("tiny", ["eval.validation_prompts=-1"])


def test_eval_command_picks_the_held_out_set(tmp_path):
    from dflash_jax.eval import parse_args, tau_stderr

    _, config = parse_args(["--config", "demo"])
    assert config.options.split == "test"
    _, config = parse_args(["--config", "demo", "eval.split=validation"])
    assert config.options.split == "validation" and config.run.eval.validation_prompts == 32
    with pytest.raises(ConfigError, match="eval.split"):
        parse_args(["--config", "demo", "eval.split=train"])
    assert tau_stderr([1.0, 2.0, None, 3.0]) == pytest.approx(1.0 / 3**0.5)
    assert tau_stderr([1.5]) is None


def test_the_feature_cache_identity_changes_with_a_validation_set_only(tmp_path):
    """The training records change only when a validation set is held out: caches built before it
    existed keep their identity."""
    from dflash_jax.training.feature_cache import data_fingerprint

    path = tmp_path / "chats.jsonl"
    sources.write_chat_jsonl(path, _dataset(n_pairs=0))
    base = data_fingerprint(DataConfig(sources=[str(path)], heldout_count=4))
    assert not {"validation_count", "validation_fraction"} & set(base)
    assert data_fingerprint(DataConfig(sources=[str(path)], heldout_count=4, validation_count=4)) != base
    assert data_fingerprint(DataConfig(sources=[str(path)], heldout_count=4, validation_count=0)) == base
