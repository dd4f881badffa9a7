"""Run setup: what a training run is made of before its first step.

Resolves the target (an HF dir, ``smollm2``, or a random ``tiny`` one built here), the tokenizer,
the mask token, the drafter config, and the optional warm start (``init_params_from``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import jax
from flax import nnx

from convert.smollm2 import smollm2_dir
from dflash_jax.config_io import ConfigError
from dflash_jax.training.run_config import RunConfig, TargetSection

log = logging.getLogger(__name__)


def tiny_target_key(section: TargetSection, vocab_size: int) -> str:
    """Everything that shapes a tiny target, as a directory name: a cached one is reused only
    when it is the same model."""
    fields = dict(
        vocab=vocab_size,
        hidden=section.tiny_hidden_size,
        layers=section.tiny_num_layers,
        seed=section.tiny_seed,
        recipe=TINY_TARGET_RECIPE,
    )
    if section.tiny_model_type in _TINY_MOE_TYPES:  # (the older kinds keep their directory names)
        fields["type"] = section.tiny_model_type
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:10]
    return f"tiny_target-h{section.tiny_hidden_size}-l{section.tiny_num_layers}-v{vocab_size}-{digest}"


TINY_TARGET_RECIPE = 1  # bump when make_tiny_target_dir builds its model differently


def make_tiny_target_dir(section: TargetSection, vocab_size: int, root: Path) -> Path:
    """A random tiny Qwen3-style target saved as an HF checkpoint (so every tool can load it),
    in ``root/<tiny_target_key>``: made once per shape, reused only for the same shape."""
    from safetensors.numpy import save_file

    from convert.hf_target import export_target_state
    from dflash_jax.layers import RopeConfig
    from dflash_jax.target.config import TargetConfig
    from dflash_jax.target.model import TargetModel

    directory = Path(root) / tiny_target_key(section, vocab_size)
    marker = directory / "config.json"
    if marker.is_file():
        return directory
    H = section.tiny_hidden_size
    tc = TargetConfig(
        model_type="qwen3",
        vocab_size=vocab_size,
        hidden_size=H,
        intermediate_size=2 * H,
        num_layers=section.tiny_num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=H // 4,
        qk_norm=True,
        rope=RopeConfig(theta=1e6),
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    )
    if section.tiny_model_type == "qwen3_5":
        return _make_tiny_hybrid_dir(tc, section.tiny_seed, directory)
    if section.tiny_model_type in _TINY_MOE_TYPES:
        return _make_tiny_moe_dir(tc, section.tiny_model_type, section.tiny_seed, directory)
    model = TargetModel(tc, rngs=nnx.Rngs(section.tiny_seed))
    # Unit-scale embeddings: a trained LM's next-token distribution is peaked, and the tied
    # lm_head then gives the drafter logits it can actually separate (0.02 init is ~uniform).
    model.embed_tokens[...] = model.embed_tokens[...] * 10.0
    directory.mkdir(parents=True, exist_ok=True)
    save_file(export_target_state(model), directory / "model.safetensors", metadata={"format": "pt"})
    hf = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": H,
        "intermediate_size": 2 * H,
        "num_hidden_layers": tc.num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": H // 4,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "tie_word_embeddings": True,
        "max_position_embeddings": 4096,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    marker.write_text(json.dumps(hf, indent=2))
    return directory


def _make_tiny_hybrid_dir(dense, seed: int, directory: Path) -> Path:
    """The Qwen3.5-hybrid variant of the tiny target: layers of 3 Gated DeltaNet + 1 gated attention."""
    from dataclasses import replace

    from safetensors.numpy import save_file

    from convert.hf_target import export_target_state
    from dflash_jax.target.hybrid import HybridTargetModel

    L, H = dense.num_layers, dense.hidden_size
    tc = replace(
        dense,
        model_type="qwen3_5",
        layer_types=tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(L)),
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=H // 4,
        linear_value_head_dim=H // 4,
        partial_rotary_factor=0.25,
    )
    model = HybridTargetModel(tc, rngs=nnx.Rngs(seed))
    model.embed_tokens[...] = model.embed_tokens[...] * 10.0  # as for the dense tiny target
    directory.mkdir(parents=True, exist_ok=True)
    save_file(export_target_state(model), directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(
        json.dumps({**tc.to_hf_dict(), "torch_dtype": "float32"}, indent=2)
    )
    return directory


_TINY_MOE_TYPES = ("qwen3_moe", "gpt_oss", "qwen3_5_moe")


def _make_tiny_moe_dir(dense, model_type: str, seed: int, directory: Path) -> Path:
    """A mixture-of-experts variant of the tiny target, every layer a MoE block of 8 experts,
    top-2: qwen3_moe; gpt_oss (sliding window 16 / full layers, sinks, clamped SwiGLU with
    biases); qwen3_5_moe (the tiny hybrid's layers with a shared expert)."""
    from dataclasses import replace

    from safetensors.numpy import save_file

    from convert.hf_target import export_target_state
    from dflash_jax.target.hybrid import build_target_model

    L, H = dense.num_layers, dense.hidden_size
    moe = dict(
        model_type=model_type,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=H,
        norm_topk_prob=model_type != "gpt_oss",
        moe_layers=tuple(range(L)),
    )
    if model_type == "gpt_oss":
        moe.update(
            intermediate_size=H,  # one width in gpt-oss's config.json: the experts'
            qk_norm=False,
            attention_bias=True,
            o_proj_bias=True,
            attention_sinks=True,
            sliding_window=16,
            swiglu_limit=7.0,
            layer_types=tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(L)),
        )
    elif model_type == "qwen3_5_moe":
        moe.update(
            layer_types=tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(L)),
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=H // 4,
            linear_value_head_dim=H // 4,
            partial_rotary_factor=0.25,
            shared_expert_intermediate_size=H,
        )  # intermediate_size stays (no dense MLP uses it): the drafter's default width
    tc = replace(dense, **moe)
    model = build_target_model(tc, rngs=nnx.Rngs(seed))
    model.embed_tokens[...] = model.embed_tokens[...] * 10.0  # as for the dense tiny target
    model.moe.router[...] = model.moe.router[...] * 50.0  # a router that prefers some experts
    directory.mkdir(parents=True, exist_ok=True)
    save_file(export_target_state(model), directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(
        json.dumps({**tc.to_hf_dict(), "torch_dtype": "float32"}, indent=2)
    )
    return directory


def resolve_target(cfg: RunConfig, run_dir: Path) -> tuple[Path, Path]:
    """-> (target dir, tokenizer dir)."""
    from transformers import AutoTokenizer

    t = cfg.target
    if t.path == "tiny":
        tok_dir = Path(t.tokenizer) if t.tokenizer and t.tokenizer != "smollm2" else smollm2_dir()
        vocab = len(AutoTokenizer.from_pretrained(tok_dir))
        return make_tiny_target_dir(t, vocab, run_dir), tok_dir
    target_dir = resolve_target_dir(t)
    tok = t.tokenizer
    tok_dir = smollm2_dir() if tok == "smollm2" else Path(tok) if tok else target_dir
    return target_dir, tok_dir


def resolve_target_dir(section: TargetSection) -> Path:
    """The directory of a target given by path (``smollm2``: the prepared package asset); a tiny
    target has none until its tokenizer is read (``resolve_target``)."""
    if section.path == "tiny":
        raise ConfigError("target.path=tiny: the tiny target is made inside the run dir (resolve_target)")
    return smollm2_dir() if section.path == "smollm2" else Path(section.path)


def check_data_sources(cfg: RunConfig) -> None:
    """The target and tokenizer directories and every configured data file exist (named by their
    keys if not), and a ``data.features`` cache is readable (manifest, shard files), checked
    before any model is built."""
    from dflash_jax.data.sources import resolve_source

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
        resolve_source(source)
    if cfg.data.features and cfg.data.features != "auto":
        from dflash_jax.training.feature_cache import FeatureCache

        FeatureCache(cfg.data.features)


def check_layout(cfg: RunConfig, num_devices: int, process_count: int) -> tuple[int, int, int]:
    """The batch against the mesh, the micro-batches and the data shards: checked with the rest of
    the config, before the output dir is touched (found at the first step, 13 s in and after the
    step-0 checkpoint, a wrong size left a run dir that refused the corrected rerun). Returns the
    mesh's (data, fsdp, tensor) sizes."""
    from dflash_jax.data.shards import shards_of_process

    mesh = cfg.mesh
    if mesh.num_devices is not None:
        if not 1 <= mesh.num_devices <= num_devices:
            raise ConfigError(f"mesh.num_devices={mesh.num_devices} but {num_devices} devices are available")
        num_devices = mesh.num_devices
    try:
        data, fsdp, tensor = mesh.resolve(num_devices)
    except ValueError as e:
        raise ConfigError(
            f"mesh.data={mesh.data}, mesh.fsdp={mesh.fsdp}, mesh.tensor={mesh.tensor} do not fit "
            f"{num_devices} devices ({e}); -1 takes the devices left"
        ) from None
    rows, splits = cfg.data.batch_size, cfg.train.micro_batches
    if rows % splits:
        raise ConfigError(
            f"train.micro_batches={splits} does not divide data.batch_size={rows}: each micro-batch takes an "
            "equal share of the batch's rows"
        )
    if rows % (data * fsdp):
        raise ConfigError(
            f"data.batch_size={rows} rows cannot be split over mesh data x fsdp = {data} x {fsdp} = "
            f"{data * fsdp} devices (rows are sharded over both): make data.batch_size a multiple of "
            f"{data * fsdp}, or change mesh.data/mesh.fsdp"
        )
    if not cfg.data.features:
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
    return data, fsdp, tensor


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


def load_warm_start(path: str, target):
    """The drafter to warm-start from (a z-lab HF dir or one of our checkpoint dirs)."""
    from dflash_jax.loading import load_drafter

    return load_drafter(path, target)


def build_drafter_config(
    cfg: RunConfig, target_config, tokenizer, source=None, source_path: str | None = None
):
    """The drafter config of this run for a target of ``target_config``: the section's fields over
    the warm-start ``source``'s config (everything it defines is kept: taps and their order, mask
    token, layer types, window, in-block causality, embedding/logit scales, soft-cap), or over the
    defaults without one (the mask token then comes from ``tokenizer``)."""
    from dflash_jax.drafter.config import DrafterConfig

    d = cfg.drafter
    # train.compute_dtype: the dtype of the drafter's matmul products (fp32 weights and activations)
    impl = dict(
        attention_impl=d.attention_impl, anchor_chunk=d.anchor_chunk, matmul_dtype=cfg.train.compute_dtype
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
        return source.replace(**impl, **extra, param_dtype="float32", compute_dtype="float32")
    shape = {name: getattr(d, name) for name in SHAPE_FIELDS if getattr(d, name) is not None}
    for name, default in SHAPE_DEFAULTS.items():
        shape.setdefault(name, default)
    if "mask_token_id" not in shape:
        shape["mask_token_id"] = choose_mask_token_id(tokenizer, target_config.vocab_size)
    num_layers, mask_id = shape.pop("num_layers"), shape.pop("mask_token_id")
    return DrafterConfig.for_target(
        target_config, num_layers=num_layers, mask_token_id=mask_id, **shape, **impl
    )


def make_drafter(cfg: RunConfig, parts, mesh, *, resume: bool, features_dir, run_dir: Path, quiet: bool):
    """The run's drafter before it is placed on the mesh: initialised (random, from the target's
    own layers with ``drafter.init: target``, or the warm start's weights) and, with a draft
    vocabulary, its ids chosen once (``draft_vocab.json`` in the run dir). A resume restores all of
    it from the checkpoint afterwards."""
    from dflash_jax import distributed
    from dflash_jax.drafter.api import init_drafter
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


def tuple_if_list(value):
    return tuple(value) if isinstance(value, list) else value


def init_params_from(drafter, source, path: str) -> None:
    """Copy the warm-start ``source``'s parameters into ``drafter`` (same config but kernels)."""
    from dflash_jax.drafter.api import get_params, set_params

    params = get_params(source)
    if drafter.draft_vocab is not None and "draft_vocab" not in params:  # chosen after this
        params["draft_vocab"] = drafter.draft_vocab[...]
    set_params(drafter, params)
    log.info("initialised drafter from %s", path)


def init_from_target_layers(drafter, target, first_layer: int | None = None) -> None:
    """Start the drafter from ``num_layers`` consecutive decoder layers of the target, from
    ``first_layer`` (``drafter.init_first_layer``; default: the last ones): attention, MLP and their
    norms copied (q/k norms, absent in Llama/Qwen2, stay 1), ``hidden_norm`` as the input norm of
    the first copied layer and the final norm as the target's. ``fc`` selects one tap (the others
    start at 0): the layer before the first copied one when it is a tap, so that the context enters
    the first drafter layer as that target layer's own input (z-lab's default taps end at N-3, the
    layer before the last two), else the last tap. ``drafter.init: target``."""
    import jax.numpy as jnp
    import numpy as np

    from dflash_jax.drafter.api import get_params, set_params

    cfg, tc = drafter.config, target.config
    stack = getattr(target, "layers", None)
    names = set(getattr(stack, "names", ()))
    need = {"input_norm", "q", "k", "v", "o", "post_norm", "gate", "up", "down"}
    extra = names - need - {"q_norm", "k_norm"}
    if not need <= names or extra:
        raise ConfigError(
            f"drafter.init=target needs a dense target without biases (its layers have {sorted(names)}); "
            "use drafter.init=random"
        )
    if (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) != (
        tc.num_heads,
        tc.num_kv_heads,
        tc.head_dim,
        tc.intermediate_size,
    ):
        raise ConfigError("drafter.init=target needs the drafter's heads and MLP width to be the target's")
    first = tc.num_layers - cfg.num_layers if first_layer is None else first_layer
    if first_layer is None and first < 0:
        raise ConfigError(
            f"drafter.init=target: the drafter's {cfg.num_layers} layers outnumber the target's {tc.num_layers}"
        )
    if not 0 <= first <= tc.num_layers - cfg.num_layers:
        raise ConfigError(
            f"drafter.init_first_layer={first_layer}: the drafter's {cfg.num_layers} layers from there "
            f"run past the target's {tc.num_layers} (the last start is {tc.num_layers - cfg.num_layers})"
        )
    w = {n: np.asarray(jax.device_get(getattr(stack, n)[...]), np.float32) for n in names}
    params = jax.tree.map(np.asarray, jax.device_get(get_params(drafter)))
    D, K = cfg.hidden_size, cfg.num_target_features
    taps = list(cfg.target_layer_ids)
    tap = taps.index(first - 1) if first - 1 in taps else K - 1
    fc = np.zeros((K * D, D), np.float32)
    fc[tap * D : (tap + 1) * D, :] = np.eye(D, dtype=np.float32)
    params["fc"] = fc
    params["hidden_norm"]["weight"] = w["input_norm"][first]
    params["norm"]["weight"] = np.asarray(jax.device_get(target.norm[...]), np.float32)
    for i in range(cfg.num_layers):
        src, layer = first + i, params["layers"][i]
        attn = layer["self_attn"]
        for ours, theirs in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"), ("o_proj", "o")):
            attn[ours] = w[theirs][src]
        for norm in ("q_norm", "k_norm"):
            if norm in names:
                attn[norm]["weight"] = w[norm][src]
        layer["input_layernorm"]["weight"] = w["input_norm"][src]
        layer["post_attention_layernorm"]["weight"] = w["post_norm"][src]
        for ours, theirs in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
            layer["mlp"][ours] = w[theirs][src]
    set_params(drafter, jax.tree.map(jnp.asarray, params))
    log.info(
        "initialised the drafter from target layers %d..%d (fc selects tap %d)",
        first,
        first + cfg.num_layers - 1,
        taps[tap],
    )
