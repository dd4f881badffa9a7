"""Drafter configuration: a frozen, validated dataclass, plus z-lab HF config dict conversion.

A DFlash drafter is a small Qwen3-style decoder whose keys/values are projected from
``[ctx ; block]``: ``ctx = hidden_norm(fc(features))`` summarises the raw outputs of the target
layers ``target_layer_ids`` (invariant 1), the block is ``block_size`` noise slots embedded by the
target's ``embed_tokens``. Its hidden size equals the target's (it shares embed/lm_head).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from dflash_jax.config_io import ConfigError, check_fields, from_dict
from dflash_jax.dtypes import DtypeName
from dflash_jax.layers import RopeConfig

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LayerType = Literal["full_attention", "sliding_attention"]
AttentionImpl = Literal["auto", "pallas", "tokamax", "xla", "reference"]
# The module that must import for ``attention_impl: pallas`` (pallas_kernels needs only jax).
PALLAS_KERNEL_MODULE = "pallas_kernels.anchored_attention"


def require_pallas_kernel(field_name: str) -> None:
    """Raise ConfigError naming ``field_name`` unless the Pallas attention kernel imports."""
    try:
        importlib.import_module(PALLAS_KERNEL_MODULE)
    except ImportError as e:
        raise ConfigError(
            f"{field_name}='pallas' needs the Pallas kernel {PALLAS_KERNEL_MODULE}, which does not "
            f"import here ({e}); use 'xla'"
        ) from e


def require_attention_impl(field_name: str, impl: str) -> None:
    """Raise ConfigError naming ``field_name`` if ``impl`` needs something that is not installed:
    the Pallas kernel for ``pallas``, tokamax for ``tokamax``."""
    if impl in ("pallas", "tokamax"):
        require_pallas_kernel(field_name)
    if impl == "tokamax":
        from pallas_kernels.anchored_attention import tokamax_impl

        why = tokamax_impl.available()
        if why is not None:
            raise ConfigError(f"{field_name}='tokamax': {why}; pip install tokamax, or use 'pallas' / 'xla'")


# Keys of a z-lab config's ``dflash_config`` sub-dict that we understand. Anything else there is a
# drafter variant we do not implement (DFlash2 convolutions, Domino projectors, ...): reject it.
_ZLAB_DFLASH_KEYS = (
    "mask_token_id",
    "target_layer_ids",
    "block_size",
    "num_target_layers",
    "input_embedding_scale",
    "output_multiplier",
    "final_logit_softcapping",
)
# Top-level keys that mark a drafter variant this model does not implement.
_UNSUPPORTED_HF_KEYS = (
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "selector_top_k",
    "projector_type",
)


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """Default target taps, as z-lab picks them: evenly spaced over [1, N-3], rounded half-to-even.

    N=36, n=5 -> (1, 9, 17, 25, 33); N=64, n=5 -> (1, 16, 31, 46, 61); n=1 -> (N // 2,).
    """
    if num_target_layers < 1 or num_draft_layers < 1:
        raise ValueError(
            f"build_target_layer_ids needs positive sizes, got num_target_layers={num_target_layers}, "
            f"num_draft_layers={num_draft_layers}"
        )
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    lo, hi = 1, num_target_layers - 3
    # Python's round() is half-to-even, which is what the reference uses too.
    return tuple(round(lo + i * (hi - lo) / (num_draft_layers - 1)) for i in range(num_draft_layers))


def _require_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"DrafterConfig.{name} must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class DrafterConfig:
    """Hyper-parameters of a DFlash drafter.

    Sizes (``hidden_size``, ``vocab_size``) must match the target; ``target_num_layers`` is the
    target depth N and ``target_layer_ids`` the K taps whose raw outputs ``fc`` concatenates
    (default ``build_target_layer_ids(N, num_layers)``).

    Attention per layer (``layer_types[i]``): ``full_attention`` or ``sliding_attention`` with
    ``sliding_window`` (in positions). Inside a block the slots see each other bidirectionally,
    except where ``causal_in_block`` says otherwise: ``None`` follows z-lab's rule (sliding layers
    causal, full layers bidirectional), ``True``/``False`` force every layer (z-lab's ``is_causal``).

    ``attention_impl``: ``auto`` (on GPU the kernel a GPU check validated for this configuration,
    ``pallas_kernels/anchored_attention/validated.json``, else ``xla``; ``xla`` off GPU),
    ``reference`` (dense, for tests), ``xla`` (anchor-chunked, memory-bounded), ``pallas`` (the
    kernel in ``pallas_kernels``; interpret mode off GPU), ``tokamax`` (tokamax's Hopper forward
    with our backward; needs tokamax). ``anchor_chunk``: anchors per chunk in ``xla``.
    ``embedding_scale``/``logit_scale``/``logit_softcap`` mirror z-lab's ``input_embedding_scale``,
    ``output_multiplier`` and ``final_logit_softcapping``.

    Dtypes: ``param_dtype`` the weights' (training keeps them fp32, cast at use);
    ``compute_dtype`` the activations' (hidden states, q/k/v, MLP; RMSNorm statistics, RoPE and
    the attention's softmax statistics are fp32 whatever it is; training sets it from
    ``train.activation_dtype``, bfloat16 by default only on GPUs); ``matmul_dtype`` the dtype the
    projections form their products in (summed in fp32; ``layers.project``), None =
    ``compute_dtype``; training sets it from ``train.compute_dtype``. bfloat16 activations are what
    ``attention_impl: auto`` matches against a bfloat16 entry of ``validated.json``.

    ``draft_vocab_size`` (invariant 9): None drafts over the target's whole vocabulary; N drafts
    over N chosen rows of the target's frozen lm_head (which rows: the drafter's ``draft_vocab``
    variable, chosen by ``training/draft_vocab.py``), mapped back to target ids when decoding.
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    target_num_layers: int
    mask_token_id: int
    block_size: int = 16
    target_layer_ids: tuple[int, ...] | None = None
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 40960
    layer_types: tuple[LayerType, ...] | None = None
    sliding_window: int | None = None
    causal_in_block: bool | None = None
    embedding_scale: float = 1.0
    logit_scale: float = 1.0
    logit_softcap: float | None = None
    attention_impl: AttentionImpl = "auto"
    anchor_chunk: int = 16
    param_dtype: DtypeName = "float32"
    compute_dtype: DtypeName = "float32"
    matmul_dtype: DtypeName | None = None
    draft_vocab_size: int | None = None

    def __post_init__(self):
        check_fields(self)
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "vocab_size",
            "target_num_layers",
            "max_position_embeddings",
            "anchor_chunk",
        ):
            _require_int(name, getattr(self, name), minimum=1)
        _require_int("block_size", self.block_size, minimum=2)
        _require_int("mask_token_id", self.mask_token_id, minimum=0)
        if self.mask_token_id >= self.vocab_size:
            raise ValueError(
                f"DrafterConfig.mask_token_id={self.mask_token_id} is outside the vocabulary "
                f"(vocab_size={self.vocab_size})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"DrafterConfig.num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"DrafterConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"DrafterConfig.rms_norm_eps must be positive, got {self.rms_norm_eps}")
        if not isinstance(self.rope, RopeConfig):
            raise ValueError(f"DrafterConfig.rope must be a RopeConfig, got {type(self.rope).__name__}")

        ids = self.target_layer_ids
        if ids is None:
            ids = build_target_layer_ids(self.target_num_layers, self.num_layers)
        ids = tuple(ids)
        if not ids:
            raise ValueError("DrafterConfig.target_layer_ids must not be empty")
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.target_num_layers:
                raise ValueError(
                    f"DrafterConfig.target_layer_ids={list(ids)}: {i!r} is not a layer of a "
                    f"{self.target_num_layers}-layer target (valid: 0..{self.target_num_layers - 1})"
                )
        if len(set(ids)) != len(ids):
            raise ValueError(
                f"DrafterConfig.target_layer_ids={list(ids)} repeats a layer; pass distinct ids "
                f"explicitly (the default spacing collides for a {self.target_num_layers}-layer target)"
            )
        object.__setattr__(self, "target_layer_ids", ids)

        types = self.layer_types
        types = (FULL_ATTENTION,) * self.num_layers if types is None else tuple(types)
        if len(types) != self.num_layers:
            raise ValueError(
                f"DrafterConfig.layer_types has {len(types)} entries for num_layers={self.num_layers}"
            )
        object.__setattr__(self, "layer_types", types)
        if self.sliding_window is not None:
            _require_int("sliding_window", self.sliding_window, minimum=1)
        if SLIDING_ATTENTION in types and self.sliding_window is None:
            raise ValueError(
                "DrafterConfig.layer_types has sliding_attention layers but sliding_window is None"
            )
        if self.logit_softcap is not None and not self.logit_softcap > 0:
            raise ValueError(
                f"DrafterConfig.logit_softcap must be positive or None, got {self.logit_softcap}"
            )
        require_attention_impl("DrafterConfig.attention_impl", self.attention_impl)
        if self.draft_vocab_size is not None:
            _require_int("draft_vocab_size", self.draft_vocab_size, minimum=2)
            if self.draft_vocab_size > self.vocab_size:
                raise ValueError(
                    f"DrafterConfig.draft_vocab_size={self.draft_vocab_size} is larger than the target's "
                    f"vocabulary (vocab_size={self.vocab_size})"
                )

    @property
    def head_size(self) -> int:
        """How many logits the drafter produces: the draft vocabulary, else the target's."""
        return self.vocab_size if self.draft_vocab_size is None else self.draft_vocab_size

    # ---------------------------------------------------------------------------------------
    # Derived values
    # ---------------------------------------------------------------------------------------

    @property
    def num_target_features(self) -> int:
        """K: how many target layers fc concatenates."""
        return len(self.target_layer_ids)

    @property
    def feature_size(self) -> int:
        """K * hidden_size: the width of the features fc consumes."""
        return self.num_target_features * self.hidden_size

    def layer_window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == SLIDING_ATTENTION else None

    def layer_causal(self, layer: int) -> bool:
        """Whether slot k of a block sees only slots <= k in this layer (z-lab's rule by default)."""
        if self.causal_in_block is not None:
            return self.causal_in_block
        return self.layer_types[layer] == SLIDING_ATTENTION

    def replace(self, **changes) -> DrafterConfig:
        return dataclasses.replace(self, **changes)

    # ---------------------------------------------------------------------------------------
    # Construction from a target / our own dicts
    # ---------------------------------------------------------------------------------------

    @classmethod
    def for_target(
        cls,
        target_config,
        *,
        num_layers: int,
        mask_token_id: int,
        block_size: int = 16,
        target_layer_ids: Sequence[int] | None = None,
        **overrides,
    ) -> DrafterConfig:
        """A drafter shaped like the target (width, heads, RoPE, eps), with ``num_layers`` layers.

        ``target_config`` is duck-typed: ``hidden_size``, ``intermediate_size``, ``num_layers``,
        ``num_heads``, ``num_kv_heads``, ``head_dim``, ``rms_norm_eps``, ``rope``, ``vocab_size``,
        ``max_position_embeddings``. ``overrides`` replace any other field.
        """
        base = dict(
            hidden_size=target_config.hidden_size,
            intermediate_size=target_config.intermediate_size,
            num_heads=target_config.num_heads,
            num_kv_heads=target_config.num_kv_heads,
            head_dim=target_config.head_dim,
            vocab_size=target_config.vocab_size,
            target_num_layers=target_config.num_layers,
            rms_norm_eps=target_config.rms_norm_eps,
            rope=target_config.rope,
            max_position_embeddings=target_config.max_position_embeddings,
        )
        base.update(overrides)
        base.update(
            num_layers=num_layers,
            mask_token_id=mask_token_id,
            block_size=block_size,
            target_layer_ids=target_layer_ids,
        )
        return from_dict(cls, base)

    def check_target(self, target_config) -> None:
        """Raise ValueError if this drafter cannot run on ``target_config`` (duck-typed)."""
        for ours, theirs in (
            ("hidden_size", "hidden_size"),
            ("vocab_size", "vocab_size"),
            ("target_num_layers", "num_layers"),
        ):
            a, b = getattr(self, ours), getattr(target_config, theirs)
            if a != b:
                raise ValueError(f"drafter {ours}={a} does not match the target's {theirs}={b}")

    def to_dict(self) -> dict:
        """Plain JSON/YAML-able dict (our own format; see to_hf_dict for z-lab's)."""
        out = dataclasses.asdict(self)
        out["rope"] = dataclasses.asdict(self.rope)
        out["target_layer_ids"] = list(self.target_layer_ids)
        out["layer_types"] = list(self.layer_types)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DrafterConfig:
        """Inverse of to_dict, through config_io: unknown keys are an error naming them."""
        return from_dict(cls, d)

    # ---------------------------------------------------------------------------------------
    # z-lab HF config (a Qwen3Config with DFlash fields) in and out
    # ---------------------------------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any], **overrides) -> DrafterConfig:
        """Read a z-lab ``DFlashDraftModel`` config.json dict.

        DFlash fields are looked up in ``dflash_config`` first, then at the top level (as z-lab
        does). Generic HF keys we do not need are ignored; features we do not implement
        (attention bias, non-SiLU MLPs, DFlash2/Domino variants) are errors. ``overrides`` set
        our own fields (attention_impl, dtypes, ...).
        """
        dflash = dict(hf.get("dflash_config") or {})
        bad = set(dflash) - set(_ZLAB_DFLASH_KEYS)
        if bad:
            raise ValueError(f"z-lab config: unsupported dflash_config keys {sorted(bad)}")
        bad = [k for k in _UNSUPPORTED_HF_KEYS if k in hf]
        if bad:
            raise ValueError(f"z-lab config: keys of an unsupported drafter variant: {bad}")
        archs = hf.get("architectures") or ["DFlashDraftModel"]
        if list(archs) != ["DFlashDraftModel"]:
            raise ValueError(f"z-lab config: architectures={archs}; only ['DFlashDraftModel'] is supported")
        if hf.get("model_type", "qwen3") != "qwen3":
            raise ValueError(f"z-lab config: model_type={hf.get('model_type')!r}; expected 'qwen3'")
        if hf.get("attention_bias", False):
            raise ValueError("z-lab config: attention_bias=True is not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"z-lab config: hidden_act={hf.get('hidden_act')!r}; only 'silu' is supported")

        def value(name, default=None):
            return dflash.get(name, hf.get(name, default))

        for name in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "vocab_size",
        ):
            if name not in hf:
                raise ValueError(f"z-lab config: missing {name!r}")
        if value("num_target_layers") is None:
            raise ValueError("z-lab config: missing 'num_target_layers'")
        if value("mask_token_id") is None:
            raise ValueError("z-lab config: missing 'mask_token_id' (in dflash_config or top level)")

        num_layers = int(hf["num_hidden_layers"])
        num_heads = int(hf["num_attention_heads"])
        # Qwen3Config semantics: the window applies only when use_sliding_window is set.
        window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
        layer_types = hf.get("layer_types")
        if layer_types is None:
            first_sliding = int(hf.get("max_window_layers", 28))
            layer_types = [
                SLIDING_ATTENTION if window is not None and i >= first_sliding else FULL_ATTENTION
                for i in range(num_layers)
            ]
        softcap = value("final_logit_softcapping")
        ids = value("target_layer_ids")
        is_causal = hf.get("is_causal")
        kw = dict(
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // num_heads),
            vocab_size=int(hf["vocab_size"]),
            target_num_layers=int(value("num_target_layers")),
            mask_token_id=int(value("mask_token_id")),
            block_size=int(value("block_size", 16)),
            target_layer_ids=None if ids is None else tuple(int(i) for i in ids),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(dict(hf)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 40960)),
            layer_types=tuple(layer_types),
            # A window only matters for sliding layers; drop it otherwise so validation is simple.
            sliding_window=int(window) if window is not None and SLIDING_ATTENTION in layer_types else None,
            causal_in_block=None if is_causal is None else bool(is_causal),
            embedding_scale=float(value("input_embedding_scale", 1.0)),
            logit_scale=float(value("output_multiplier", 1.0)),
            logit_softcap=None if softcap is None or float(softcap) <= 0 else float(softcap),
        )
        kw.update(overrides)
        return cls(**kw)

    def to_hf_dict(self, *, dtype: str | None = None) -> dict:
        """A z-lab-format config.json dict (loadable by ``dflash.model.DFlashDraftModel``)."""
        if self.draft_vocab_size is not None:
            raise ValueError(
                f"z-lab's DFlashDraftModel format has no reduced vocabulary, and this drafter has "
                f"draft_vocab_size={self.draft_vocab_size}: export it with --format speculators"
            )
        rope = self.rope.to_hf()
        sliding = SLIDING_ATTENTION in self.layer_types
        dflash = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)}
        if self.embedding_scale != 1.0:
            dflash["input_embedding_scale"] = self.embedding_scale
        if self.logit_scale != 1.0:
            dflash["output_multiplier"] = self.logit_scale
        if self.logit_softcap is not None:
            dflash["final_logit_softcapping"] = self.logit_softcap
        out = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope.theta,
            "rope_parameters": rope,
            "rope_scaling": None if self.rope.rope_type == "default" else rope,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "layer_types": list(self.layer_types),
            "use_sliding_window": sliding,
            "sliding_window": self.sliding_window if sliding else None,
            "max_window_layers": self.num_layers,
            "num_target_layers": self.target_num_layers,
            "block_size": self.block_size,
            "dflash_config": dflash,
        }
        if self.causal_in_block is not None:
            out["is_causal"] = self.causal_in_block
        if dtype is not None:
            out["dtype"] = dtype
        return out
