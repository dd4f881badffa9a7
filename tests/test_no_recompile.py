"""Compiles are counted, not timed: a training run and a speculative evaluation over varying data
compile each jitted function once per shape bucket, never once per step or per prompt."""

from __future__ import annotations

import logging
import re
from collections import Counter
from contextlib import contextmanager

import jax

from dflash_jax.training.run_config import load_run_config


@contextmanager
def count_compiles():
    """Counter of XLA compilations by function name, from ``jax_log_compiles``."""
    counts: Counter = Counter()
    pattern = re.compile(r"Compiling (?:jit\()?([\w<>.]+)")

    class Grab(logging.Handler):
        def emit(self, record):
            m = pattern.search(record.getMessage())
            if m:
                counts[m.group(1)] += 1

    handler = Grab(level=logging.DEBUG)
    root = logging.getLogger("jax")
    root.addHandler(handler)
    old_level = root.level
    root.setLevel(logging.DEBUG)
    with jax.log_compiles(True):
        try:
            yield counts
        finally:
            root.removeHandler(handler)
            root.setLevel(old_level)


def test_training_compiles_the_step_once(tmp_path):
    from dflash_jax.train import run

    cfg = load_run_config(
        "tiny",
        [
            f"output_dir={tmp_path}",
            "train.steps=5",
            "train.warmup_steps=1",
            "train.log_every=1",
            "train.checkpoint_every=2",
            "mesh.num_devices=1",
            "mesh.data=1",
            "data.max_records=80",
        ],
    )
    with count_compiles() as counts:
        result = run(cfg, quiet=True)
    assert result["step"] == 5
    # Five different packed batches (and a checkpoint between them): one compile of the step.
    assert counts["train_step"] == 1, dict(counts)


def test_speculative_eval_compiles_per_bucket_not_per_prompt(tmp_path):
    import numpy as np

    from convert.tiny_target import make_tiny_target_dir
    from dflash_jax.decoding.evaluation import evaluate
    from dflash_jax.drafter.api import init_drafter
    from dflash_jax.drafter.config import DrafterConfig
    from dflash_jax.loading import load_target

    cfg = load_run_config("tiny", [f"output_dir={tmp_path}"])
    target = load_target(make_tiny_target_dir(cfg.target, 512, tmp_path / "t"))
    dcfg = DrafterConfig.for_target(
        target.config, num_layers=1, mask_token_id=511, block_size=4, target_layer_ids=(1, 3)
    )
    drafter = init_drafter(dcfg, target, 0)
    rng = np.random.default_rng(0)

    def prompts(lengths):
        return [rng.integers(0, 500, size=n).tolist() for n in lengths]

    kw = dict(max_new_tokens=12, batch_size=2, baseline=True, warmup=False)
    evaluate(target, drafter, prompts([5, 9]), **kw)  # first batch: compiles
    with count_compiles() as counts:
        # Same length bucket (<= 64 tokens), different lengths, contents and batch fill.
        evaluate(target, drafter, prompts([3, 17, 30, 41, 7]), **kw)
    assert sum(counts.values()) == 0, dict(counts)
    with count_compiles() as counts:
        evaluate(target, drafter, prompts([70, 100]), **kw)  # a new bucket: a bounded few
    assert 0 < sum(counts.values()) <= 12, dict(counts)
