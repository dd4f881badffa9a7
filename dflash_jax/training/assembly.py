"""A run's parts, resolved once: ``assemble(cfg)``, then ``load_parts``.

Training (``training/run.py``), the offline feature cache (``python -m dflash_jax.features``) and the
planner (``tools/plan.py``, ``train --plan``, the pre-flight memory check) all need the same
answers: where the target and its tokenizer are, the target's architecture, which data the run
trains on (the target's own regenerated replies when ``regen.enabled``), the held-out data, the
drafter's config (over a warm start's, when there is one). They get them from here, so the plan
is of the run that trains and the cache is of the rows it reads.

``assemble`` checks the config (target, tokenizer and data files, the mesh against the devices and
the batch) and resolves the parts reading no weight and writing nothing in the run dir; the
pre-flight check plans those very parts. ``load_parts`` then makes a tiny target, loads the target
onto the mesh, regenerates the data (cached) and reads the warm start's weights. ``abstract=True``
(the planner) reads no tokenizer either and needs no file at all where the architecture is
known: ``target.architecture``, the target's ``config.json`` (both, when both exist, and they must
agree), SmolLM2's own (``convert.smollm2.ARCHITECTURE``) or the tiny target's section.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from dflash_jax.config_io import ConfigError
from dflash_jax.dtypes import activation_dtype
from dflash_jax.training.run_config import RunConfig, TargetSection

log = logging.getLogger("dflash_jax.train")


class NoArchitecture(ConfigError):
    """An abstract description needs the target's architecture, and this config has none yet."""


@dataclass(frozen=True)
class RunParts:
    """What one run is made of: ``assemble`` fills the descriptions, ``load_parts`` the models.

    Consumers read the data sections here, never from the config: ``data`` is the one the run
    trains on (the regenerated replies once loaded with ``regen.enabled``)."""

    target_config: object  # TargetConfig
    drafter_config: object  # DrafterConfig: the section over the warm start's config, or the defaults
    data: object  # DataConfig the run trains on
    heldout: object | None  # DataConfig of the regenerated held-out replies (in-run held-out loss)
    target_dir: Path | None  # tiny: where load_parts makes it; None: abstract, no directory at hand
    tokenizer_dir: Path | None
    warm_start: str | None = None  # the drafter the run starts from (z-lab HF dir or a checkpoint)
    eval_prompts: tuple = ()  # token ids of the test prompts: tau before/after training
    eval_answers: object = None  # regen_cache.HeldoutAnswers: the target's greedy answers to them
    validation_prompts: tuple = ()  # token ids of the validation prompts: the tau curve
    validation_answers: object = None  # the target's greedy answers to them
    tokenizer: object = None  # None: abstract
    target: object = None  # None until load_parts
    warm_source: object = None  # the warm-start drafter with its weights (drop after copying them)

    @property
    def loaded(self) -> bool:
        return self.target is not None


def assemble(
    cfg: RunConfig,
    *,
    abstract: bool = False,
    run_dir: Path | None = None,
    init_from: str | None = None,
    target_config=None,
    building_features: bool = False,
    num_devices: int | None = None,
    process_count: int | None = None,
) -> RunParts:
    """Check ``cfg`` and resolve its parts, reading no weight.

    ``abstract``: no tokenizer, no file needs to exist (the planner; the mesh is checked per
    layout by the plan); ``target_config`` stands in for the run's own architecture (a sweep over
    sizes). Otherwise the config is checked before any model is built: the target, tokenizer and
    data files exist, the mesh fits ``num_devices`` (default: all) and the batch's rows split over
    it, its micro-batches and its data shards (``process_count`` processes; ``building_features``:
    the feature cache's build, on one process, through the data pipeline whatever
    ``data.features`` says). ``run_dir`` (default ``output_dir``) is where a tiny target goes;
    ``init_from`` overrides ``drafter.init_from``.
    """
    warm_start = init_from or cfg.drafter.init_from
    if abstract:
        tc = target_config or target_architecture(cfg, read_files=True)
        return _parts(cfg, tc, None, None, None, warm_start)
    import jax
    from transformers import AutoTokenizer

    check_data_sources(cfg)
    check_run_layout(
        cfg,
        jax.device_count() if num_devices is None else num_devices,
        1 if building_features else (jax.process_count() if process_count is None else process_count),
        online=building_features or not cfg.data.features,
    )
    if run_dir is None:
        run_dir = Path(cfg.output_dir).expanduser().resolve()
    t = cfg.target
    tok_dir = resolve_tokenizer_dir(t)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    if t.path == "tiny":
        from dflash_jax.target.tiny import tiny_target_config, tiny_target_key

        target_dir = Path(run_dir) / tiny_target_key(t, len(tokenizer))
        tc = target_config or tiny_target_config(t, len(tokenizer))
    else:
        target_dir = resolve_target_dir(t)
        tc = target_config or target_architecture(cfg, target_dir)
    return _parts(cfg, tc, target_dir, tok_dir, tokenizer, warm_start)


def _parts(cfg: RunConfig, tc, target_dir, tok_dir, tokenizer, warm_start) -> RunParts:
    from dflash_jax.drafter.build import build_drafter_config

    source = None
    if warm_start:  # its config only: the taps, mask token and layer types it fixes
        from convert.drafter_reader import read_drafter_config

        source = read_drafter_config(warm_start)
    section = cfg.drafter
    if tokenizer is None and section.mask_token_id is None and source is None:
        # The mask token only picks an embedding row; any valid row plans the same program.
        section = dataclasses.replace(section, mask_token_id=tc.vocab_size - 1)
    dcfg = build_drafter_config(
        section,
        tc,
        compute_dtype=cfg.train.compute_dtype,
        activation_dtype=activation_dtype(cfg.train.activation_dtype, cfg.train.compute_dtype),
        tokenizer=tokenizer,
        source=source,
        source_path=warm_start,
    )
    return RunParts(
        target_config=tc,
        drafter_config=dcfg,
        data=cfg.data,
        heldout=None,
        target_dir=None if target_dir is None else Path(target_dir),
        tokenizer_dir=None if tok_dir is None else Path(tok_dir),
        warm_start=warm_start,
        tokenizer=tokenizer,
    )


def prepare_target_dir(cfg: RunConfig, parts: RunParts) -> Path:
    """Make the run's tiny target in ``parts.target_dir`` (once per shape); other targets exist."""
    if cfg.target.path == "tiny":
        from convert.tiny_target import make_tiny_target_dir

        made = make_tiny_target_dir(cfg.target, parts.target_config.vocab_size, parts.target_dir.parent)
        assert made == parts.target_dir, (made, parts.target_dir)
    return parts.target_dir


def load_parts(cfg: RunConfig, parts: RunParts, *, mesh=None) -> RunParts:
    """``parts`` with their models: the target loaded onto ``mesh`` (a tiny one made first), the
    held-out prompts, the regenerated data (cached) and the warm start's weights."""
    import dflash_jax
    from dflash_jax.loading import load_drafter
    from dflash_jax.training import evaluation
    from dflash_jax.training.regen_cache import HeldoutAnswers, data_configs, regenerated_data

    target_dir, tokenizer = prepare_target_dir(cfg, parts), parts.tokenizer
    target = dflash_jax.load_target(
        target_dir, dtype=cfg.target.dtype, mesh=mesh, attention_impl=cfg.target.attention_impl
    )
    tc = target.config
    if tc != parts.target_config:
        raise ConfigError(
            f"{target_dir}: the loaded target differs from the one the run was planned for in "
            f"{', '.join(_differing_fields(parts.target_config, tc))}"
        )
    log.info(
        "target %s: %d layers, hidden %d, vocab %d", target_dir, tc.num_layers, tc.hidden_size, tc.vocab_size
    )
    held_prompts = evaluation.heldout_prompts(cfg, tokenizer)  # a bad prompt file fails before regen
    val_prompts = evaluation.heldout_prompts(cfg, tokenizer, "validation")
    eval_prompts = tuple(ids for _, ids in held_prompts)
    validation_prompts = tuple(ids for _, ids in val_prompts)
    data, heldout, answers, val_answers = parts.data, None, None, None
    if cfg.regen.enabled:
        train_path, held_path, answers_path, val_path = regenerated_data(
            cfg, target, tokenizer, target_dir, held_prompts, val_prompts
        )
        data, heldout = data_configs(cfg, train_path, held_path)
        answers = _answers_to(HeldoutAnswers.read(answers_path), eval_prompts, answers_path)
        val_answers = _answers_to(HeldoutAnswers.read(val_path), validation_prompts, val_path)
    source = load_drafter(parts.warm_start, target) if parts.warm_start else None
    return dataclasses.replace(
        parts,
        data=data,
        heldout=heldout,
        eval_prompts=eval_prompts,
        eval_answers=answers,
        validation_prompts=validation_prompts,
        validation_answers=val_answers,
        target=target,
        warm_source=source,
    )


def _answers_to(answers, prompts: tuple, path: Path):
    """``answers`` when they answer ``prompts``, else None (tau is then decoded, not replayed)."""
    if not prompts:
        return None
    if answers.prompts != tuple(tuple(p) for p in prompts) or not answers.answers:
        log.warning("%s: not the answers to this run's eval prompts; tau is decoded, not replayed", path)
        return None
    return answers


def _differing_fields(a, b, prefix: str = "") -> list[str]:
    """``name (a's value against b's)`` for each field that differs; a nested config by the fields
    of it that differ, a long sequence by its length, so the message stays one readable line."""
    out = []
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if x == y:
            continue
        name = prefix + f.name
        if dataclasses.is_dataclass(x) and type(x) is type(y):
            out += _differing_fields(x, y, prefix=f"{name}.")
        else:
            out.append(f"{name} ({_brief(x)} against {_brief(y)})")
    return out


def _brief(value) -> str:
    if isinstance(value, (tuple, list)) and len(value) > 4:
        return f"{len(value)} entries"
    return repr(value)


# --------------------------------------------------------------------------- the target


def target_architecture(cfg: RunConfig, target_dir: Path | None = None, *, read_files: bool = False):
    """The target's TargetConfig without touching its weights: its ``config.json`` (in
    ``target_dir``; with ``read_files`` the configured target's, where it exists) checked against
    ``target.architecture`` when both exist, else ``target.architecture``; ``smollm2``: the
    conversion's own architecture; ``tiny`` (``read_files``): its section's, over the tokenizer's
    size (SmolLM2's known without its files)."""
    from dflash_jax.target.config import TargetConfig

    t = cfg.target
    written = TargetConfig.from_hf_dict(dict(t.architecture)) if t.architecture else None
    if target_dir is None and read_files:
        if t.path == "tiny":
            from dflash_jax.target.tiny import tiny_target_config

            return tiny_target_config(t, _tokenizer_size(t))
        if t.path == "smollm2":
            from convert.smollm2 import ARCHITECTURE

            return _agreeing(written, TargetConfig.from_hf_dict(ARCHITECTURE), "SmolLM2's config.json")
        candidate = Path(t.path).expanduser()
        target_dir = candidate if (candidate / "config.json").is_file() else None
    if target_dir is not None and (Path(target_dir) / "config.json").is_file():
        path = Path(target_dir) / "config.json"
        return _agreeing(written, TargetConfig.from_pretrained(Path(target_dir)), str(path))
    if written is not None:
        return written
    where = f"{target_dir}/config.json" if target_dir is not None else f"target.path={t.path}"
    raise NoArchitecture(
        f"cannot describe the run: {where} does not exist and the config has no target.architecture"
    )


def _agreeing(written, read, where: str):
    """``read`` (the model's own config), refused when ``target.architecture`` says otherwise."""
    if written is not None and written != read:
        raise ConfigError(
            f"target.architecture disagrees with {where} in "
            f"{', '.join(_differing_fields(written, read))}: fix or remove target.architecture"
        )
    return read


def _tokenizer_size(section: TargetSection) -> int:
    """Tokens of the tiny target's tokenizer, from its files (not weights); SmolLM2's is known."""
    if section.tokenizer in (None, "smollm2"):
        from convert.smollm2 import TOKENIZER_SIZE

        return TOKENIZER_SIZE
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(_existing_dir(section.tokenizer, "target.tokenizer")))


def resolve_target_dir(section: TargetSection) -> Path:
    """The directory of a target given by path (``smollm2``: the prepared package asset, converted
    on first use); a tiny target's is named by its shape inside the run dir (``assemble``)."""
    from convert.smollm2 import smollm2_dir

    if section.path == "tiny":
        raise ConfigError("target.path=tiny: the tiny target is made inside the run dir (assemble)")
    return smollm2_dir() if section.path == "smollm2" else Path(section.path)


def resolve_tokenizer_dir(section: TargetSection) -> Path:
    """``target.tokenizer``: a directory, ``smollm2`` (also a tiny target's default), or unset: the
    target's directory."""
    from convert.smollm2 import smollm2_dir

    tok = section.tokenizer
    if tok == "smollm2" or (tok is None and section.path == "tiny"):
        return smollm2_dir()
    return Path(tok) if tok else resolve_target_dir(section)


def target_and_tokenizer_dirs(cfg: RunConfig, run_dir: Path) -> tuple[Path, Path]:
    """(target dir, tokenizer dir) for a command that loads the target outside a training run
    (``eval``, ``regenerate``): a tiny target is made in ``run_dir`` as a run makes it."""
    tok_dir = resolve_tokenizer_dir(cfg.target)
    if cfg.target.path != "tiny":
        return resolve_target_dir(cfg.target), tok_dir
    from convert.tiny_target import make_tiny_target_dir

    return make_tiny_target_dir(cfg.target, _tokenizer_size(cfg.target), Path(run_dir)), tok_dir


def _existing_dir(path: str, key: str) -> Path:
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ConfigError(f"{key}={path}: no such directory")
    return p


# --------------------------------------------------------------------------- checks


def check_data_sources(cfg: RunConfig) -> None:
    """The target and tokenizer directories and every configured data file exist (named by their
    keys if not; an ``hf:`` dataset must be in the local hub cache), and a ``data.features`` cache is readable (manifest, shard files), checked
    before any model is built."""
    from dflash_jax.data.sources import HF_PREFIX, open_table, resolve_source

    t = cfg.target
    # Named by their keys here: later, transformers' "Repo id must be in the form ..." names neither.
    if t.path not in ("tiny", "smollm2") and not Path(t.path).expanduser().is_dir():
        raise ConfigError(f"target.path={t.path}: no such directory (an HF model directory, smollm2 or tiny)")
    if t.tokenizer not in (None, "smollm2") and not Path(t.tokenizer).expanduser().is_dir():
        raise ConfigError(
            f"target.tokenizer={t.tokenizer}: no such directory (a directory with the tokenizer files, "
            "or smollm2; unset: the target's directory)"
        )
    for source in cfg.data.sources:
        path, _ = resolve_source(source)
        if path.startswith(HF_PREFIX):
            open_table(path)  # in the local hub cache, or refused now (nothing is downloaded)
    if cfg.data.features and cfg.data.features != "auto":
        from dflash_jax.training.feature_cache import FeatureCache

        FeatureCache(cfg.data.features)


def check_run_layout(cfg: RunConfig, num_devices: int, process_count: int, *, online: bool) -> tuple:
    """The batch against the mesh (``sharding.check_layout``), the micro-batches and the data
    shards: checked with the rest of the config, before the output dir is touched (found at the
    first step, 13 s in and after the step-0 checkpoint, a wrong size left a run dir that refused
    the corrected rerun). ``online``: rows through the data pipeline's shards (else from a feature
    cache). Returns the mesh's (data, fsdp, tensor) sizes."""
    from dflash_jax.data.shards import shards_of_process
    from dflash_jax.sharding import check_layout

    rows, splits = cfg.data.batch_size, cfg.train.micro_batches
    sizes = check_layout(cfg.mesh, num_devices, batch_rows=rows)
    if rows % splits:
        raise ConfigError(
            f"train.micro_batches={splits} does not divide data.batch_size={rows}: each micro-batch takes an "
            "equal share of the batch's rows"
        )
    if online:
        shards = cfg.data.shards or process_count
        if shards < 1 or shards % process_count:
            raise ConfigError(
                f"data.shards={shards} must be a positive multiple of the number of processes ({process_count})"
            )
        if rows % shards:
            raise ConfigError(
                f"data.shards={shards} does not divide data.batch_size={rows}: every shard gives each "
                "batch the same number of rows"
            )
        shards_of_process(shards, 0, process_count)
    elif rows % process_count:
        raise ConfigError(f"data.batch_size={rows} is not divisible by the {process_count} processes")
    return sizes


# --------------------------------------------------------------------------- the drafter


def make_drafter(
    cfg: RunConfig, parts: RunParts, mesh, *, resume: bool, features_dir, run_dir: Path, quiet: bool
):
    """The run's drafter before it is placed on the mesh: initialised (random, from the target's
    own layers with ``drafter.init: target``, or the warm start's weights) and, with a draft
    vocabulary, its ids chosen once (``draft_vocab.json`` in the run dir). A resume restores all of
    it from the checkpoint afterwards."""
    from dflash_jax import distributed
    from dflash_jax.drafter.api import init_drafter
    from dflash_jax.drafter.init import init_from_target_layers, init_params_from
    from dflash_jax.training import draft_vocab

    target, source = parts.target, parts.warm_source
    drafter = init_drafter(parts.drafter_config, target, cfg.train.seed)
    if source is None and cfg.drafter.init == "target" and not resume:
        init_from_target_layers(drafter, target, first_layer=cfg.drafter.init_first_layer)
    has_vocab = False
    if source is not None:
        init_params_from(drafter, source, parts.warm_start)
        has_vocab = source.config.draft_vocab_size is not None
    if parts.drafter_config.draft_vocab_size is not None and not resume and not has_vocab:
        primary = distributed.is_primary()
        summary = draft_vocab.choose_for_run(
            cfg,
            drafter,
            target,
            parts.tokenizer,
            parts.data,
            mesh,
            features_dir=features_dir,
            quiet=quiet or not primary,
        )
        if primary:
            (run_dir / "draft_vocab.json").write_text(json.dumps(summary, indent=2))
    return drafter
