"""A run's parts, resolved in one place: ``assemble(cfg)``.

Training (``training/run.py``), the offline feature cache (``python -m dflash_jax.features``) and the
planner (``tools/plan.py``, ``train --plan``, the pre-flight memory check) all need the same
answers: where the target and its tokenizer are, the target's architecture, which data the run
trains on (the target's own regenerated replies when ``regen.enabled``), the held-out data, the
drafter's config (over a warm start's, when there is one). They get them from here, so the plan
is of the run that trains and the cache is of the rows it reads.

Two depths: ``abstract=True`` reads no weight and no tokenizer (the architecture comes from
``target.architecture`` or the target's ``config.json``) for the planner; the default loads the
target onto the mesh, the tokenizer, regenerates the data (cached), and reads the warm start.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dflash_jax.config_io import ConfigError
from dflash_jax.training.run_config import RunConfig

log = logging.getLogger("dflash_jax.train")


class NoArchitecture(ConfigError):
    """An abstract description needs the target's architecture, and this config has none yet."""


@dataclass(frozen=True)
class RunParts:
    """What one run is made of. ``target``, ``tokenizer`` and ``warm_source`` are None when abstract."""

    target_config: object  # TargetConfig
    drafter_config: object  # DrafterConfig: the section over the warm start's config, or the defaults
    data: object  # DataSection the run trains on (the regenerated replies when regen.enabled)
    heldout: object | None  # DataSection of the regenerated held-out replies (in-run held-out loss)
    target_dir: Path | None  # None: abstract from target.architecture
    tokenizer_dir: Path | None
    warm_start: str | None = None  # the drafter the run starts from (z-lab HF dir or a checkpoint)
    eval_prompts: tuple = ()  # token ids of the held-out prompts tau is measured on
    eval_answers: object = None  # regen_cache.HeldoutAnswers: the target's greedy answers to them
    target: object = None
    tokenizer: object = None
    warm_source: object = None  # the warm-start drafter with its weights (drop after copying them)

    @property
    def abstract(self) -> bool:
        return self.target is None


def assemble(
    cfg: RunConfig,
    *,
    abstract: bool = False,
    run_dir: Path | None = None,
    mesh=None,
    init_from: str | None = None,
    target_dir: Path | None = None,
    target_config=None,
    before_target_loads: Callable[[Path], object] | None = None,
) -> RunParts:
    """Resolve ``cfg``'s parts.

    ``abstract``: no weights, no tokenizer, no regeneration (``target_dir`` may point at the
    config.json to read; a ``target.path: tiny`` config has no architecture before its tokenizer
    is read and is refused; ``target_config`` stands in for the run's own architecture, e.g. in a
    sweep over sizes). Concrete: ``run_dir`` holds what a run makes (the tiny target), the
    target is loaded onto ``mesh``; ``before_target_loads(target_dir)`` runs first (the pre-flight
    memory check); ``init_from`` overrides ``drafter.init_from``.
    """
    warm_start = init_from or cfg.drafter.init_from
    if abstract:
        return _abstract(cfg, target_config or target_architecture(cfg, target_dir), target_dir, warm_start)
    from transformers import AutoTokenizer

    import dflash_jax
    from dflash_jax.training import evaluation, setup
    from dflash_jax.training.regen_cache import HeldoutAnswers, data_configs, regenerated_data

    if run_dir is None:
        run_dir = Path(cfg.output_dir).expanduser().resolve()
    target_dir, tok_dir = setup.resolve_target(cfg, run_dir)
    if before_target_loads is not None:
        before_target_loads(target_dir)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    target = dflash_jax.load_target(target_dir, dtype=cfg.target.dtype, mesh=mesh)
    tc = target.config
    log.info(
        "target %s: %d layers, hidden %d, vocab %d", target_dir, tc.num_layers, tc.hidden_size, tc.vocab_size
    )
    held_prompts = evaluation.heldout_prompts(cfg, tokenizer)  # a bad prompt file fails before regen
    eval_prompts = tuple(ids for _, ids in held_prompts)
    data, heldout, answers = cfg.data, None, None
    if cfg.regen.enabled:
        train_path, held_path, answers_path = regenerated_data(
            cfg, target, tokenizer, target_dir, held_prompts
        )
        data, heldout = data_configs(cfg, train_path, held_path)
        answers = HeldoutAnswers.read(answers_path)
        if answers.prompts != tuple(tuple(p) for p in eval_prompts) or not answers.answers:
            log.warning(
                "%s: not the answers to this run's eval prompts; tau is decoded, not replayed", answers_path
            )
            answers = None
    source = setup.load_warm_start(warm_start, target) if warm_start else None
    dcfg = setup.build_drafter_config(
        cfg, tc, tokenizer, source=None if source is None else source.config, source_path=warm_start
    )
    return RunParts(
        target_config=tc,
        drafter_config=dcfg,
        data=data,
        heldout=heldout,
        target_dir=Path(target_dir),
        tokenizer_dir=Path(tok_dir),
        warm_start=warm_start,
        eval_prompts=eval_prompts,
        eval_answers=answers,
        target=target,
        tokenizer=tokenizer,
        warm_source=source,
    )


def target_architecture(cfg: RunConfig, target_dir: Path | None = None):
    """The target's TargetConfig without touching its weights: ``target.architecture`` (HF
    config.json fields written in the run config), else ``target_dir``'s or the configured
    target's config.json."""
    from dflash_jax.target.config import TargetConfig

    t = cfg.target
    if t.architecture:
        return TargetConfig.from_hf_dict(dict(t.architecture))
    if target_dir is None:
        if t.path == "tiny":
            raise NoArchitecture(
                "target.path=tiny has no architecture before its tokenizer is read; plan a real config"
            )
        from dflash_jax.training.setup import resolve_target_dir

        target_dir = resolve_target_dir(t)
    path = Path(target_dir)
    if not (path / "config.json").is_file():
        raise NoArchitecture(
            f"cannot describe the run: {path}/config.json does not exist and the config has no "
            "target.architecture"
        )
    return TargetConfig.from_pretrained(path)


def _abstract(cfg: RunConfig, tc, target_dir: Path | None, warm_start: str | None) -> RunParts:
    from dflash_jax.training.setup import build_drafter_config

    source = None
    if warm_start:  # its config only: the taps, mask token and layer types it fixes
        from convert.drafter_reader import read_drafter_config

        source = read_drafter_config(warm_start)
    if cfg.drafter.mask_token_id is None and source is None:
        # The mask token only picks an embedding row; any valid row plans the same program.
        cfg = dataclasses.replace(
            cfg, drafter=dataclasses.replace(cfg.drafter, mask_token_id=tc.vocab_size - 1)
        )
    dcfg = build_drafter_config(cfg, tc, tokenizer=None, source=source, source_path=warm_start)
    return RunParts(
        target_config=tc,
        drafter_config=dcfg,
        data=cfg.data,
        heldout=None,
        target_dir=None if target_dir is None else Path(target_dir),
        tokenizer_dir=None,
        warm_start=warm_start,
    )
