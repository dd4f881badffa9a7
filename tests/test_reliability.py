"""Runs fail fast and clearly and never keep a bad state (issue 16): one test per item.

1. non-finite steps apply no update; the run stops after N in a row with a finite checkpoint
2. no hangs: data that yields nothing fails naming the filter
3. output dirs never mix runs; cached artefacts are keyed by their shape; --resume checks the config
4. one error path (``error: ...``, exit 2); the whole config is validated before any model is built
5. the output dir is checked writable; a failed checkpoint save fails the run at that save
6. metrics truncated on resume; SIGTERM exits 143; a skip-fraction limit; exports refuse bad --out
"""

from __future__ import annotations

import json
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from transformers import AutoTokenizer

from dflash_jax import assets
from dflash_jax.data import pipeline, sources
from dflash_jax.data.pipeline import DataConfig, make_train_iterator

# ------------------------------------------------------------------------------------ helpers


def _chat(i: int, words: int = 12) -> dict:
    text = " ".join(["word"] * words)
    return {
        "id": f"c{i}",
        "messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": text}],
    }


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(assets.smollm2_dir())


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    sources.write_chat_jsonl(path, [_chat(i) for i in range(12)])
    return str(path)


def _data_cfg(path, **kw):
    base = dict(sources=[path], max_length=64, batch_size=2, num_epochs=None, prefetch=0)
    base.update(kw)
    return DataConfig(**base)


@pytest.fixture(scope="module")
def tiny_models():
    """A tiny random Qwen3-style target and a one-layer drafter (no files, no torch)."""
    from dflash_jax.drafter.api import init_drafter
    from dflash_jax.drafter.config import DrafterConfig
    from dflash_jax.layers import RopeConfig
    from dflash_jax.target.config import TargetConfig
    from dflash_jax.target.model import TargetModel

    tc = TargetConfig(
        model_type="qwen3",
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        qk_norm=True,
        rope=RopeConfig(theta=1e6),
        tie_word_embeddings=True,
        max_position_embeddings=512,
    )
    target = TargetModel(tc, rngs=nnx.Rngs(0))
    dcfg = DrafterConfig.for_target(tc, num_layers=1, mask_token_id=255, block_size=4)
    return target, dcfg, init_drafter(dcfg, target, 0)


def _batch(T=32, rows=2, seed=0):
    rng = np.random.default_rng(seed)
    loss_mask = np.zeros((rows, T), np.int32)
    loss_mask[:, 8:] = 1
    return {
        "input_ids": jnp.asarray(rng.integers(0, 250, (rows, T)), jnp.int32),
        "positions": jnp.asarray(np.tile(np.arange(T), (rows, 1)), jnp.int32),
        "segment_ids": jnp.ones((rows, T), jnp.int32),
        "loss_mask": jnp.asarray(loss_mask),
    }


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


# ------------------------------------------------------------------- 1. non-finite updates


def test_nonfinite_step_applies_no_update(tiny_models):
    """A step whose loss/gradients are NaN leaves params and optimizer state (count included)
    exactly as they were and reports skipped=1; a finite step then updates as usual."""
    from dflash_jax.training.step import StepConfig, make_train_step

    target, dcfg, drafter = tiny_models
    drafter = nnx.clone(drafter)
    optimizer = nnx.Optimizer(drafter, optax_adam(), wrt=nnx.Param)
    step = make_train_step(StepConfig(block_size=4, max_anchors=4, target_layer_ids=tuple(dcfg.target_layer_ids)))
    poisoned = nnx.clone(target)
    poisoned.embed_tokens[...] = poisoned.embed_tokens[...] * jnp.nan  # NaN lm_head -> NaN loss
    before_p = _leaves(nnx.to_pure_dict(nnx.state(drafter, nnx.Param)))
    before_o = _leaves(nnx.to_pure_dict(nnx.state(optimizer, nnx.optimizer.OptState)))
    m = step(drafter, optimizer, poisoned, _batch(), jax.random.key(0))
    assert not np.isfinite(float(m["loss"])) and int(m["skipped"]) == 1
    after_p = _leaves(nnx.to_pure_dict(nnx.state(drafter, nnx.Param)))
    after_o = _leaves(nnx.to_pure_dict(nnx.state(optimizer, nnx.optimizer.OptState)))
    for a, b in zip(before_p + before_o, after_p + after_o, strict=True):
        np.testing.assert_array_equal(a, b)
    m = step(drafter, optimizer, target, _batch(), jax.random.key(0))
    assert np.isfinite(float(m["loss"])) and int(m["skipped"]) == 0
    assert int(optimizer.step[...]) == 1
    changed = [not np.array_equal(a, b) for a, b in zip(before_p, _leaves(nnx.to_pure_dict(nnx.state(drafter, nnx.Param))), strict=True)]
    assert any(changed)


def optax_adam():
    import optax

    return optax.adam(1e-2)


# --------------------------------------------------------------------------- 2. no hangs


def _error_of_next(it, seconds: float) -> BaseException:
    """The exception ``next(it)`` raises within ``seconds`` (a daemon thread: a hang fails the test)."""
    out: list = []

    def pull():
        try:
            out.append(next(it))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out.append(e)

    t = threading.Thread(target=pull, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"no batch and no error after {seconds} s: the pipeline hangs")
    assert isinstance(out[0], BaseException), "a batch came out of data that has no trainable document"
    return out[0]


def test_no_trainable_document_fails_naming_the_filter(tokenizer, chats):
    """max_length=2 drops every document; with num_epochs=None this used to spin forever."""
    err = _error_of_next(make_train_iterator(_data_cfg(chats, max_length=2), tokenizer), 60)
    assert isinstance(err, ValueError) and re.search(r"length filter.*data.max_length=2", str(err)), err
    big = _data_cfg(chats, min_loss_tokens=1000, max_length=2048)
    err = _error_of_next(make_train_iterator(big, tokenizer), 60)
    assert isinstance(err, ValueError) and re.search(r"loss-mask filter.*min_loss_tokens=1000", str(err)), err


# ------------------------------------------------------------- 6c. skipped-records limit


def test_skip_fraction_above_the_limit_fails_naming_the_reasons(tmp_path, chats):
    """A Latin-1 file whose records are mostly undecodable fails the load instead of training on
    the few that survive; the error names the reason, where it was first seen, and the key."""
    good = [json.dumps(_chat(i)) for i in range(3)]
    bad = [json.dumps(_chat(10 + i), ensure_ascii=False).replace("question", "quéstion") for i in range(7)]
    path = tmp_path / "latin1.jsonl"
    path.write_bytes("\n".join(good + bad).encode("latin-1") + b"\n")
    cfg = _data_cfg(str(path))
    with pytest.raises(ValueError, match=rf"skipped 7 of 10 .*data.max_skip_fraction=0.1: malformed_json: 7 \(first at {path}:4\)"):
        pipeline.load_index(cfg)
    index, report = pipeline.load_index(_data_cfg(str(path), max_skip_fraction=0.8))
    assert len(index) == 3 and report.num_skipped == 7
