"""The drafter config of a run: its ``drafter`` section over a warm start's config, or over the
defaults (taps spaced over the target, the mask token picked from the tokenizer)."""

from __future__ import annotations

from dflash_jax.config_io import ConfigError
from dflash_jax.drafter.config import DrafterConfig

# Section fields that describe the drafter's shape (DrafterConfig fields of the same name).
SHAPE_FIELDS = (
    "num_layers",
    "block_size",
    "target_layer_ids",
    "mask_token_id",
    "intermediate_size",
    "layer_types",
    "sliding_window",
    "causal_in_block",
    "draft_vocab_size",
)
SHAPE_DEFAULTS = {"num_layers": 1, "block_size": 16}


def choose_mask_token_id(tokenizer, vocab_size: int) -> int:
    """An embedding row that never appears as data: the first row past the tokenizer when the
    vocabulary is padded (as z-lab does for Qwen3), else the tokenizer's mask/unused special token."""
    n = len(tokenizer)
    if n < vocab_size:
        return n
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id)
    reserved = {tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id}
    specials = [i for i in tokenizer.all_special_ids if i not in reserved]
    if specials:
        return int(max(specials))
    raise ConfigError("cannot pick a mask token: set drafter.mask_token_id")


def tuple_if_list(value):
    return tuple(value) if isinstance(value, list) else value


def build_drafter_config(
    section,
    target_config,
    *,
    compute_dtype: str = "float32",
    activation_dtype: str = "float32",
    tokenizer=None,
    source: DrafterConfig | None = None,
    source_path: str | None = None,
) -> DrafterConfig:
    """The drafter config for a target of ``target_config`` from a run's ``drafter`` ``section``:
    its fields over the warm-start ``source`` config (everything it defines is kept: taps and their
    order, mask token, layer types, window, in-block causality, embedding/logit scales, soft-cap),
    or over the defaults without one (the mask token then comes from ``tokenizer`` unless the
    section sets it). ``compute_dtype`` (``train.compute_dtype``): the dtype of the matmul products;
    ``activation_dtype`` (``train.activation_dtype`` resolved, ``dtypes.activation_dtype``): the
    drafter's activations (its config's ``compute_dtype``). Weights are fp32 either way."""
    d = section
    impl = dict(
        attention_impl=d.attention_impl,
        anchor_chunk=d.anchor_chunk,
        matmul_dtype=compute_dtype,
        compute_dtype=activation_dtype,
    )
    if source is not None:
        extra = {}
        for name in SHAPE_FIELDS:
            ours, theirs = getattr(d, name), getattr(source, name)
            if name == "draft_vocab_size" and theirs is None and ours is not None:
                extra[name] = ours  # a full-vocabulary drafter may start a reduced-vocabulary run
                continue
            if ours is not None and tuple_if_list(ours) != tuple_if_list(theirs):
                raise ConfigError(
                    f"drafter.{name}={ours!r} conflicts with the warm-start drafter {source_path}, "
                    f"which has {name}={theirs!r} (leave drafter.{name} unset to keep it)"
                )
        source.check_target(target_config)
        # Training keeps fp32 master weights whatever precision the source was stored in.
        return source.replace(**impl, **extra, param_dtype="float32")
    shape = {name: getattr(d, name) for name in SHAPE_FIELDS if getattr(d, name) is not None}
    for name, default in SHAPE_DEFAULTS.items():
        shape.setdefault(name, default)
    if "mask_token_id" not in shape:
        if tokenizer is None:
            raise ConfigError("cannot pick a mask token without the tokenizer: set drafter.mask_token_id")
        shape["mask_token_id"] = choose_mask_token_id(tokenizer, target_config.vocab_size)
    num_layers, mask_id = shape.pop("num_layers"), shape.pop("mask_token_id")
    return DrafterConfig.for_target(
        target_config, num_layers=num_layers, mask_token_id=mask_id, **shape, **impl
    )
