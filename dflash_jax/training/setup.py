"""Run setup: what a training run is made of before its first step.

Resolves the target (an HF dir, ``smollm2``, or a random ``tiny`` one built here), the tokenizer,
the mask token, the drafter config, and the optional warm start (``init_params_from``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from flax import nnx

from convert.smollm2 import smollm2_dir
from dflash_jax.config_io import ConfigError
from dflash_jax.training.run_config import RunConfig, TargetSection

log = logging.getLogger(__name__)


def make_tiny_target_dir(section: TargetSection, vocab_size: int, directory: Path) -> Path:
    """A random tiny Qwen3-style target saved as an HF checkpoint (so every tool can load it)."""
    from safetensors.numpy import save_file

    from convert.hf_target import export_target_state
    from dflash_jax.layers import RopeConfig
    from dflash_jax.target.config import TargetConfig
    from dflash_jax.target.model import TargetModel

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
    (directory / "config.json").write_text(json.dumps({**tc.to_hf_dict(), "torch_dtype": "float32"}, indent=2))
    return directory


def resolve_target(cfg: RunConfig, run_dir: Path) -> tuple[Path, Path]:
    """-> (target dir, tokenizer dir)."""
    from transformers import AutoTokenizer

    t = cfg.target
    if t.path == "tiny":
        tok_dir = Path(t.tokenizer) if t.tokenizer and t.tokenizer != "smollm2" else smollm2_dir()
        vocab = len(AutoTokenizer.from_pretrained(tok_dir))
        return make_tiny_target_dir(t, vocab, run_dir / "tiny_target"), tok_dir
    target_dir = smollm2_dir() if t.path == "smollm2" else Path(t.path)
    tok = t.tokenizer
    tok_dir = smollm2_dir() if tok == "smollm2" else Path(tok) if tok else target_dir
    return target_dir, tok_dir


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


def build_drafter_config(cfg: RunConfig, target, tokenizer):
    from dflash_jax.drafter.config import DrafterConfig

    d = cfg.drafter
    mask_id = (
        d.mask_token_id
        if d.mask_token_id is not None
        else choose_mask_token_id(tokenizer, target.config.vocab_size)
    )
    overrides = dict(attention_impl=d.attention_impl, anchor_chunk=d.anchor_chunk)
    if d.intermediate_size is not None:
        overrides["intermediate_size"] = d.intermediate_size
    if d.layer_types is not None:
        overrides.update(layer_types=tuple(d.layer_types), sliding_window=d.sliding_window)
    return DrafterConfig.for_target(
        target.config,
        num_layers=d.num_layers,
        mask_token_id=mask_id,
        block_size=d.block_size,
        target_layer_ids=d.target_layer_ids,
        **overrides,
    )


def init_params_from(drafter, path: str, target) -> None:
    """Warm start from a z-lab HF drafter dir or one of our checkpoint dirs."""
    from dflash_jax.drafter.api import get_params, set_params
    from dflash_jax.loading import load_drafter

    src = load_drafter(path, target)
    if (
        src.config.block_size != drafter.config.block_size
        or src.config.num_layers != drafter.config.num_layers
    ):
        raise ConfigError(
            f"init_from {path}: drafter has {src.config.num_layers} layers / block {src.config.block_size}, "
            f"config asks {drafter.config.num_layers} / {drafter.config.block_size}"
        )
    set_params(drafter, get_params(src))
    log.info("initialised drafter from %s", path)
