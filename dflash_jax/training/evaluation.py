"""Held-out evaluation during training: loss/streak on held-out batches and tau.

Held-out prompts are never trained on, and come in two disjoint sets (``data/splits.py``): the
**test** prompts give the run's reported figures (tau and the held-out loss/streak before and after
training, ``eval_before.json`` / ``eval_after.json``), the **validation** prompts the tau curve
during training, what a choice may be made on without biasing the test figure. Tau after training
is measured by greedy speculative decoding (:func:`dflash_jax.decoding.evaluation.evaluate`). With
the target's greedy answers to the prompts at hand (the regeneration cache makes them), tau before
training and the curve during it are measured by replaying those answers
(:mod:`dflash_jax.decoding.replay`: the same steps decoding would take, in seconds instead of
minutes), and the final measurement reports its replay beside it, a check that the two agree.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time

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


def final_bench_records(cfg: RunConfig) -> dict[str, list[dict]]:
    """The conversations of each ``eval.final_bench`` set the final report decodes: the first
    ``eval.final_bench_prompts`` in the file's order (``BenchmarkUnavailable`` naming the package
    when a set's wheel is not installed; the run calls this before any model loads)."""
    from dflash_jax.decoding.benchmarks import load_benchmark

    return {name: load_benchmark(name, cfg.eval.final_bench_prompts) for name in cfg.eval.final_bench}


def num_prompts(cfg: RunConfig, split: str) -> int:
    """How many prompts of the ``test`` (``eval.num_prompts``) or ``validation``
    (``eval.validation_prompts``) set tau is measured on."""
    return cfg.eval.num_prompts if split == "test" else cfg.eval.validation_prompts


def heldout_prompts(cfg: RunConfig, tokenizer, split: str = "test") -> list[tuple[list[dict], list[int]]]:
    """(messages, token ids) of the ``split`` set's held-out prompts (never trained) tau is measured
    on: the first ``eval.num_prompts`` (test) or ``eval.validation_prompts`` (validation) of at most
    ``eval.max_prompt_tokens`` tokens."""
    from dflash_jax.data.pipeline import load_heldout_prompts
    from dflash_jax.decoding.prompts import encode_prompt

    n = num_prompts(cfg, split)
    if n == 0 or not cfg.data.holds_out(split):
        return []
    out = []
    for p in load_heldout_prompts(cfg.data, split=split):
        ids = encode_prompt(tokenizer, p["messages"], cfg.data.enable_thinking)
        if len(ids) <= cfg.eval.max_prompt_tokens:
            out.append((p["messages"], ids))
        if len(out) >= n:
            break
    if len(out) < n:
        log.warning(
            "%s set: %d held-out prompts of at most eval.max_prompt_tokens=%d tokens, fewer than the %d "
            "asked for",
            split,
            len(out),
            cfg.eval.max_prompt_tokens,
            n,
        )
    return out


def heldout_prompt_ids(cfg: RunConfig, tokenizer, split: str = "test") -> list[list[int]]:
    """Token ids of the ``split`` set's held-out prompts (never trained) for the tau evaluation."""
    return [ids for _, ids in heldout_prompts(cfg, tokenizer, split)]


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
    return _tau_report(rep["summary"], [r["tau"] for r in rep["prompts"]], "speculative decoding")


def measure_bench_tau(
    cfg: RunConfig,
    target,
    drafter,
    tokenizer,
    sets: dict[str, list[dict]],
    *,
    max_new_tokens: int | None = None,
) -> dict[str, dict]:
    """Greedy speculative decoding of benchmark conversations (``{name: decoding.benchmarks
    records}``, each turn asked after the target's own answer to the one before), every set's turn
    t in one batch (two sequential decodes for MT-Bench and HumanEval together, not three); ->
    ``{name: the report of measure_tau}``, each turn one prompt, with ``num_conversations``,
    ``tau_by_turn`` and the rows' ``ids``."""
    from dflash_jax.decoding.evaluation import evaluate_conversations, summarize
    from dflash_jax.decoding.prompts import stop_token_ids

    records = [r for recs in sets.values() for r in recs]
    rep = evaluate_conversations(
        target,
        drafter,
        records,
        tokenizer=tokenizer,
        enable_thinking=cfg.data.enable_thinking,
        max_new_tokens=cfg.eval.max_new_tokens if max_new_tokens is None else max_new_tokens,
        stop_token_ids=stop_token_ids(target.config, tokenizer),
        batch_size=max(1, len(records)),
        baseline=False,
        warmup=False,
        exact_tail=False,  # as in measure_tau
    )
    joint, rows, out = rep["summary"], iter(rep["prompts"]), {}
    for name, recs in sets.items():  # rows come record by record, turn by turn
        mine = [next(rows) for r in recs for _ in r["turns"]]
        s = summarize(
            mine,
            block_size=joint["block_size"],
            max_new_tokens=joint["max_new_tokens"],
            temperature=joint["temperature"],
            batch_size=joint["batch_size"],
            seconds=joint["seconds"],  # of the joint decode
        )
        by_turn = [
            [r["tau"] for r in mine if r.get("turn", 1) == t and r["tau"] is not None]
            for t in range(1, max(len(r["turns"]) for r in recs) + 1)
        ]
        out[name] = _tau_report(s, [r["tau"] for r in mine], "speculative decoding")
        out[name].update(
            num_conversations=len(recs),
            tau_by_turn=[sum(ts) / len(ts) if ts else None for ts in by_turn],
            ids=[r["id"] for r in mine],
        )
    return out


def replay_tau(replay, drafter) -> dict:
    """Tau of ``drafter`` by replaying the target's greedy answers (``decoding.replay.Replay``): the
    same report as :func:`measure_tau`, for the prompts and length the answers were made with."""
    from dflash_jax.decoding.evaluation import acceptance_stats

    outs = replay.outputs(drafter)
    s = {
        "num_prompts": len(outs),
        "block_size": drafter.config.block_size,
        "max_new_tokens": replay.max_new_tokens,
        **acceptance_stats(outs, drafter.config.block_size),
    }
    return _tau_report(
        s, [sum(o.acceptance_lengths) / o.num_steps if o.num_steps else None for o in outs], "replay"
    )


def _tau_report(s: dict, per_prompt_tau: list, method: str) -> dict:
    taus = np.array([t for t in per_prompt_tau if t is not None], np.float64)
    return {
        "tau": float(s["tau"]),
        "tau_stderr": float(taus.std(ddof=1) / np.sqrt(len(taus))) if len(taus) > 1 else None,
        "per_slot_acceptance": s["per_position_acceptance"],
        "per_prompt_tau": per_prompt_tau,  # prompt order: for paired differences
        "num_prompts": int(s["num_prompts"]),
        "verify_steps": int(s["num_steps"]),
        "tau_pooled": s["tau_pooled"],
        "method": method,
        "summary": s,
    }


# The final evaluation decodes; before training only replays. Its time is set aside as this many
# times the seconds the target took for its greedy answers to the same prompts (the plain decode
# that made them). docs/experiments.md, "Performance work": 42 s of answers, then 72 s and 100 s of decoding
# with trained drafters (tau 1.39 and 1.41) on the same box an hour apart; an untrained drafter
# takes ~40 % more verify steps. What this leaves uncovered, the run's 30 s margin takes.
FINAL_DECODE_OVER_ANSWERS = 2.0
# A turn of the final benchmark slice (eval.final_bench) is set aside as this many test-set prompts
# of the final decode: its batches are small (decoding time follows the sequential verify steps, not
# the rows) and MT-Bench's second turn waits for the first. On the demo's shapes 12 turns took 103 s
# and the 32 test prompts 88 s (3.1x per turn; docs/design.md, "The final report").
BENCH_TURN_OVER_TEST_PROMPT = 3.0
# A test-set prompt's share of the final decode when nothing timed it (a resume, or no test
# prompts): the demo's 32 prompts in schedule.RESUMED_FINAL_EVAL_S
UNTIMED_TEST_PROMPT_S = 120.0 / 32


class HeldoutReports:
    """What a run reports about its drafter on data it never trains on: test-set tau before/after
    training (``eval_<when>.json`` in the run dir, logged with per-slot acceptance, prefix
    ``heldout`` in the metrics), validation-set tau for the curve during training (prefix
    ``validation``), and the held-out loss/streak of the regenerated test answers.

    With the target's greedy answers to the prompts (``parts.eval_answers``,
    ``parts.validation_answers``) tau before training and on the curve is replayed (all prompts,
    full length, seconds; the curve's points at the start and end of training too), and tau after
    training is decoded with the replay beside it; without them everything is decoded (the curve on
    ``eval.curve_prompts`` validation prompts x ``eval.curve_max_new_tokens``). Every validation
    measurement goes to ``keep_best`` (``hooks.KeepBest``), which keeps the best drafter."""

    def __init__(
        self,
        cfg: RunConfig,
        parts,
        drafter,
        eval_step,
        batches,
        *,
        logger,
        result: dict,
        run_dir,
        keep_best=None,
    ):
        import jax

        self.cfg, self.parts, self.drafter, self.eval_step, self.batches = (
            cfg,
            parts,
            drafter,
            eval_step,
            batches,
        )
        self.logger, self.result, self.run_dir = logger, result, run_dir
        self.keep_best = keep_best  # hooks.KeepBest: told every validation measurement
        self.key = jax.random.key(cfg.train.seed + 1)
        self.replay = self._make_replay(parts.eval_prompts, getattr(parts, "eval_answers", None))
        self.validation_replay = self._make_replay(
            getattr(parts, "validation_prompts", ()), getattr(parts, "validation_answers", None)
        )
        self._replay_seconds: dict[str, float] = {}
        self.bench_records = final_bench_records(cfg)
        if self.replay is not None:
            self.answer_seconds = parts.eval_answers.seconds

    def _make_replay(self, prompts, answers):
        from dflash_jax.decoding.prompts import stop_token_ids
        from dflash_jax.decoding.replay import Replay

        if not answers or not prompts:
            return None
        return Replay(
            self.parts.target,
            prompts,
            answers.answers,
            layer_ids=self.drafter.config.target_layer_ids,
            max_new_tokens=answers.max_new_tokens,
            stop_token_ids=stop_token_ids(self.parts.target.config, self.parts.tokenizer),
        )

    @property
    def curve_enabled(self) -> bool:
        return bool(self.cfg.eval.curve_every_minutes) and bool(getattr(self.parts, "validation_prompts", ()))

    def final_eval_estimate_s(self, before_s: float) -> float:
        """Seconds to set aside for the test set's decoding after training, ``before_s`` being what
        the measurement before training took."""
        if self.replay is None:
            return before_s  # decoded too; an untrained drafter accepts less, so this errs long
        return FINAL_DECODE_OVER_ANSWERS * self.answer_seconds

    def bench_estimate_s(self, test_s: float) -> float:
        """Seconds to set aside for the benchmark slice after training (``eval.final_bench``),
        ``test_s`` being the test set's share (0: not timed)."""
        turns = sum(len(r["turns"]) for recs in self.bench_records.values() for r in recs)
        n = len(self.parts.eval_prompts)
        per_prompt = test_s / n if test_s > 0 and n else UNTIMED_TEST_PROMPT_S
        return BENCH_TURN_OVER_TEST_PROMPT * turns * per_prompt

    def curve_estimate_s(self, before_s: float) -> float:
        """Seconds a curve point takes (on the validation set; ``before_s``: the test set's
        measurement before training)."""
        if self.validation_replay is not None:
            return self._replay_seconds.get("validation", before_s)
        cfg, n = self.cfg.eval, len(self.parts.eval_prompts)
        n_val = len(getattr(self.parts, "validation_prompts", ()))
        if not n or not n_val:
            return 0.0
        return before_s * min(cfg.curve_prompts, n_val) / n * cfg.curve_max_new_tokens / cfg.max_new_tokens

    def _replay(self, split: str = "test") -> dict:
        replay = self.replay if split == "test" else self.validation_replay
        t0 = time.perf_counter()
        rep = replay_tau(replay, self.drafter)
        if split not in self._replay_seconds:  # the first one computes the target features and compiles
            t0 = time.perf_counter()
            rep = replay_tau(replay, self.drafter)
        self._replay_seconds[split] = time.perf_counter() - t0
        return rep

    def tau(self, when: str, step: int) -> None:
        """Test-set tau ``before`` or ``after`` training (and, by replay, the curve's point)."""
        cfg, prompts = self.cfg, list(self.parts.eval_prompts)
        if self.validation_replay is not None and self.curve_enabled:
            self.tau_curve(step)  # replayed: seconds, the curve's first and last points
        if not prompts:
            return
        if self.replay is not None and when == "before":
            rep = self._replay()
        else:
            rep = measure_tau(cfg, self.parts.target, self.drafter, self.parts.tokenizer, prompts)
            if self.replay is not None:
                rep["replay"] = self._replay()
        rep["split"] = "test"
        self.result[f"tau_{when}"], self.result[f"eval_{when}"] = rep["tau"], rep
        self.result[f"tau_{when}_stderr"] = rep["tau_stderr"]
        self.logger.log(step, {"tau": rep["tau"]}, prefix="heldout")
        (self.run_dir / f"eval_{when}.json").write_text(json.dumps(rep, indent=2))
        shown = rep["per_slot_acceptance"][:8]
        slots = " ".join("-" if a is None else f"{a:.2f}" for a in shown)
        log.info(
            "test-set tau %s training (%s): %.3f +- %.3f (s.e.) over %d prompts x %d tokens (%d verify "
            "steps); acceptance of draft slots 1..%d: %s",
            when,
            rep["method"],
            rep["tau"],
            rep["tau_stderr"] or 0.0,
            rep["num_prompts"],
            cfg.eval.max_new_tokens,
            rep["verify_steps"],
            len(shown),
            slots,
        )
        if "replay" in rep:
            diff = [
                a - b
                for a, b in zip(rep["per_prompt_tau"], rep["replay"]["per_prompt_tau"], strict=True)
                if a is not None and b is not None
            ]
            log.info(
                "the same by replay of the target's answers: %.3f (per prompt, decoding - replay: "
                "largest |difference| %.3f)",
                rep["replay"]["tau"],
                max((abs(d) for d in diff), default=0.0),
            )

    def tau_curve(self, step: int) -> dict:
        """Validation-set tau during training, for the curve in metrics.png (and the best
        checkpoint, ``keep_best``); -> its report."""
        cfg = self.cfg
        if self.validation_replay is not None:
            rep, n_tokens = self._replay("validation"), cfg.eval.max_new_tokens
        else:
            n_tokens = cfg.eval.curve_max_new_tokens
            rep = measure_tau(
                cfg,
                self.parts.target,
                self.drafter,
                self.parts.tokenizer,
                list(self.parts.validation_prompts[: cfg.eval.curve_prompts]),
                max_new_tokens=n_tokens,
            )
        self.logger.log(step, {"tau": rep["tau"]}, prefix="validation")
        log.info(
            "step %d: validation tau %.3f +- %.3f (%s, %d prompts x %d tokens)",
            step,
            rep["tau"],
            rep["tau_stderr"] or 0.0,
            rep["method"],
            rep["num_prompts"],
            n_tokens,
        )
        if self.keep_best is not None:
            self.keep_best.consider(step, rep)
        return rep

    def bench(self, step: int) -> None:
        """Tau after training on the slice of each ``eval.final_bench`` set, beside the test set's:
        ``eval_after_<set>.json``, the run's result (``bench_after``), logged and the metrics
        (prefix: the set's name)."""
        if not self.bench_records:
            return
        summary = self.result.setdefault("bench_after", {})
        reports = measure_bench_tau(
            self.cfg, self.parts.target, self.drafter, self.parts.tokenizer, self.bench_records
        )
        for name, rep in reports.items():
            rep["bench"] = name
            (self.run_dir / f"eval_after_{name}.json").write_text(json.dumps(rep, indent=2))
            self.logger.log(step, {"tau": rep["tau"]}, prefix=name)
            summary[name] = {
                k: rep[k] for k in ("tau", "tau_stderr", "num_prompts", "num_conversations", "tau_by_turn")
            }
            log.info(
                "%s tau after training (first %d conversations, %d turns x %d tokens): %.3f +- %.3f (s.e.)%s",
                name,
                rep["num_conversations"],
                rep["num_prompts"],
                self.cfg.eval.max_new_tokens,
                rep["tau"],
                rep["tau_stderr"] or 0.0,
                ""
                if len(rep["tau_by_turn"]) < 2
                else "; by turn: " + " ".join("-" if t is None else f"{t:.3f}" for t in rep["tau_by_turn"]),
            )

    def streak(self, step: int, when: str) -> None:
        metrics = heldout_metrics(self.eval_step, self.drafter, self.parts.target, self.batches, self.key)
        if metrics is not None:
            self.logger.log(step, metrics, prefix="heldout")
            self.result[f"heldout_streak_{when}"] = float(metrics["streak"])
            log.info("held-out (test) streak %s training: %.3f", when, metrics["streak"])
