"""Held-out evaluation during training: loss/streak on held-out batches and tau by speculative decoding.

Held-out prompts are never trained on; tau is measured with greedy speculative decoding
(:func:`dflash_jax.decoding.evaluation.evaluate`) before and after training.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import numpy as np

from dflash_jax.training.run_config import RunConfig

log = logging.getLogger("dflash_jax.train")


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


class HeldoutReports:
    """What a run reports about its drafter on data it never trains on: tau before/after training
    (``eval_<when>.json`` in the run dir, logged with per-slot acceptance), a short tau for the
    curve during training, and the held-out loss/streak of the regenerated held-out batches."""

    def __init__(self, cfg: RunConfig, parts, drafter, eval_step, batches, *, logger, result: dict, run_dir):
        import jax

        self.cfg, self.parts, self.drafter, self.eval_step, self.batches = (
            cfg,
            parts,
            drafter,
            eval_step,
            batches,
        )
        self.logger, self.result, self.run_dir = logger, result, run_dir
        self.key = jax.random.key(cfg.train.seed + 1)

    def tau(self, when: str) -> None:
        cfg, prompts = self.cfg, list(self.parts.eval_prompts)
        if not prompts:
            return
        rep = measure_tau(cfg, self.parts.target, self.drafter, self.parts.tokenizer, prompts)
        self.result[f"tau_{when}"], self.result[f"eval_{when}"] = rep["tau"], rep
        (self.run_dir / f"eval_{when}.json").write_text(json.dumps(rep, indent=2))
        shown = rep["per_slot_acceptance"][:8]
        slots = " ".join("-" if a is None else f"{a:.2f}" for a in shown)
        log.info(
            "held-out tau %s training: %.3f +- %.3f (s.e.) over %d prompts x %d tokens (%d verify steps); "
            "acceptance of draft slots 1..%d: %s",
            when,
            rep["tau"],
            rep["tau_stderr"] or 0.0,
            rep["num_prompts"],
            cfg.eval.max_new_tokens,
            rep["verify_steps"],
            len(shown),
            slots,
        )

    def tau_curve(self, step: int) -> None:
        """A short held-out tau during training, for the curve in metrics.png."""
        cfg = self.cfg
        rep = measure_tau(
            cfg,
            self.parts.target,
            self.drafter,
            self.parts.tokenizer,
            list(self.parts.eval_prompts[: cfg.eval.curve_prompts]),
            max_new_tokens=cfg.eval.curve_max_new_tokens,
        )
        self.logger.log(step, {"tau": rep["tau"]}, prefix="heldout")
        log.info(
            "step %d: held-out tau %.3f (%d prompts x %d tokens)",
            step,
            rep["tau"],
            rep["num_prompts"],
            cfg.eval.curve_max_new_tokens,
        )

    def streak(self, step: int, when: str) -> None:
        metrics = heldout_metrics(self.eval_step, self.drafter, self.parts.target, self.batches, self.key)
        if metrics is not None:
            self.logger.log(step, metrics, prefix="heldout")
            self.result[f"heldout_streak_{when}"] = float(metrics["streak"])
            log.info("held-out streak %s training: %.3f", when, metrics["streak"])
