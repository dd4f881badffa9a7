"""Held-out evaluation during training: loss/streak on held-out batches and tau by speculative decoding.

Held-out prompts are never trained on; tau is measured with greedy speculative decoding
(:func:`dflash_jax.decoding.evaluation.evaluate`) before and after training.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dflash_jax.training.run_config import RunConfig


def heldout_batches(tokenizer, data_cfg, n_batches: int = 2) -> list[dict]:
    """The first ``n_batches`` packed batches of ``data_cfg`` (unshuffled, one epoch)."""
    from dflash_jax.data.pipeline import make_train_iterator

    if data_cfg is None:
        return []
    it = make_train_iterator(
        dataclasses.replace(data_cfg, shuffle=False, num_epochs=1), tokenizer, role="held-out"
    )
    out = []
    for batch in it:
        out.append(batch)
        if len(out) >= n_batches:
            break
    return out


def heldout_metrics(eval_step, drafter, target, batches, key) -> dict | None:
    """Mean loss, streak and per-slot accuracy over ``batches`` (global arrays); None without any."""
    if not batches:
        return None
    ms = [eval_step(drafter, target, b, key) for b in batches]
    return {k: np.mean([np.asarray(m[k]) for m in ms], axis=0) for k in ("loss", "streak", "slot_acc")}


def heldout_prompt_ids(cfg: RunConfig, tokenizer) -> list[list[int]]:
    """Token ids of the held-out prompts (never trained) for the tau evaluation."""
    from dflash_jax.data.pipeline import load_heldout_prompts
    from dflash_jax.decoding.prompts import encode_prompt

    if cfg.eval.num_prompts == 0 or not (cfg.data.heldout_fraction > 0 or cfg.data.heldout_count):
        return []
    out = []
    for p in load_heldout_prompts(cfg.data):
        ids = encode_prompt(tokenizer, p["messages"], cfg.data.enable_thinking)
        if len(ids) <= cfg.eval.max_prompt_tokens:
            out.append(ids)
        if len(out) >= cfg.eval.num_prompts:
            break
    return out


def measure_tau(
    cfg: RunConfig, target, drafter, tokenizer, prompts, *, max_new_tokens: int | None = None
) -> dict:
    """Greedy speculative decoding of the held-out prompts: tau (z-lab's per-prompt mean) with its
    standard error over prompts, per-slot acceptance, and what it rests on."""
    from dflash_jax.decoding.evaluation import evaluate
    from dflash_jax.decoding.prompts import stop_token_ids

    rep = evaluate(
        target,
        drafter,
        prompts,
        max_new_tokens=cfg.eval.max_new_tokens if max_new_tokens is None else max_new_tokens,
        stop_token_ids=stop_token_ids(target.config, tokenizer),
        batch_size=max(1, len(prompts)),
        baseline=False,
        warmup=False,
        # The last block of a prompt is drafted at full length and verified only up to its limit:
        # the same tokens, one compile instead of one per tail length (minutes on a CPU); only the
        # acceptance of those last steps can differ from z-lab's (python -m dflash_jax.eval: exact).
        exact_tail=False,
    )
    s = rep["summary"]
    taus = np.array([r["tau"] for r in rep["prompts"] if r["tau"] is not None], np.float64)
    return {
        "tau": float(s["tau"]),
        "tau_stderr": float(taus.std(ddof=1) / np.sqrt(len(taus))) if len(taus) > 1 else None,
        "per_slot_acceptance": s["per_position_acceptance"],
        "per_prompt_tau": [r["tau"] for r in rep["prompts"]],  # prompt order: for paired differences
        "num_prompts": len(prompts),
        "verify_steps": int(s["num_steps"]),
        "tau_pooled": s["tau_pooled"],
        "summary": s,
    }
