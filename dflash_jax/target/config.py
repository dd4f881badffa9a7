"""TargetConfig: the frozen target LLM's architecture, read from an HF ``config.json``.

One decoder-only implementation covers Llama, Qwen2 (qkv bias) and Qwen3 (q/k RMSNorm); the
Qwen3.5 / Qwen3.6 text family (``model_type`` ``qwen3_5``: the vision-language wrapper, whose text
part is read from ``text_config``, or ``qwen3_5_text``) is the hybrid model of ``target/hybrid.py``:
Gated DeltaNet layers plus gated full attention with partial rotary, per ``layer_types``.

Mixture-of-experts targets (``target/moe.py``): ``qwen3_moe`` (Qwen3-30B-A3B: softmax top-k
router, ``norm_topk_prob``, MoE on the layers picked by ``decoder_sparse_step`` /
``mlp_only_layers``, dense MLP elsewhere), ``qwen3_5_moe`` (the hybrid with MoE MLPs plus a
sigmoid-gated shared expert) and ``gpt_oss`` (router with bias, top-k then softmax, experts with
biases and a clamped SwiGLU, attention sinks, alternating sliding-window / full layers, YaRN rope;
MXFP4 expert weights are dequantised at load). Anything we do not implement is rejected here with
the offending field named, never approximated.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dflash_jax.layers import RopeConfig

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_5", "qwen3_moe", "qwen3_5_moe", "gpt_oss")
# config.json model_type -> ours (the Qwen3.5 VL wrapper and its text-only form are one family)
_HF_MODEL_TYPES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_moe": "qwen3_moe",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "gpt_oss": "gpt_oss",
}
_VL_WRAPPERS = ("qwen3_5", "qwen3_5_moe")  # config.json with the text model under text_config
HYBRID_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
MOE_MODEL_TYPES = ("qwen3_moe", "qwen3_5_moe", "gpt_oss")
FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
SLIDING_ATTENTION = "sliding_attention"  # gpt-oss: full attention over the last sliding_window keys
DENSE_MLP, MOE_MLP = "dense", "moe"
MOE_MATMULS = ("auto", "ragged_dot", "tiled")  # grouped-matmul implementations (target/moe.py)


@dataclass(frozen=True)
class TargetConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v bias (Qwen2 always; Llama if attention_bias)
    o_proj_bias: bool = False  # Llama's attention_bias also puts a bias on o_proj
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k before RoPE
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # Qwen3.5 hybrid (model_type qwen3_5); ignored (and left at defaults) for dense targets.
    layer_types: tuple[str, ...] = ()  # per layer: full_attention | linear_attention; () = all full
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    partial_rotary_factor: float = 1.0  # RoPE on the first head_dim * factor dims of q and k
    # Mixture of experts (qwen3_moe, qwen3_5_moe, gpt_oss); 0 / () for dense targets.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's MLP width
    norm_topk_prob: bool = False  # renormalise the top-k router weights to sum to 1
    moe_layers: tuple[int, ...] = ()  # layers whose MLP is the MoE block (others: dense MLP)
    shared_expert_intermediate_size: int = 0  # qwen3_5_moe: the sigmoid-gated shared expert
    # gpt_oss: experts with biases and a clamped SwiGLU (swiglu_limit > 0), router with bias,
    # one learned sink logit per head, sliding_window for the sliding_attention layers.
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.702
    attention_sinks: bool = False
    sliding_window: int = 0
    # How the routed experts' grouped matmul is computed (ours, not config.json's; target/moe.py):
    # auto (ragged_dot on TPU, tiled elsewhere) | ragged_dot | tiled, with moe_tile rows per tile.
    moe_matmul: str = "auto"
    moe_tile: int = 512

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {self.model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"TargetConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"TargetConfig: num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.rotary_dim % 2 or self.rotary_dim <= 0:
            raise ValueError(
                f"TargetConfig: rotary dim head_dim*partial_rotary_factor = {self.rotary_dim} must be even and > 0"
            )
        types = tuple(self.layer_types) or (FULL_ATTENTION,) * self.num_layers
        object.__setattr__(self, "layer_types", types)
        if len(types) != self.num_layers:
            raise ValueError(
                f"TargetConfig.layer_types has {len(types)} entries for num_layers={self.num_layers}"
            )
        bad = sorted(set(types) - {FULL_ATTENTION, LINEAR_ATTENTION, SLIDING_ATTENTION})
        if bad:
            raise ValueError(f"TargetConfig.layer_types: unsupported {bad}")
        if SLIDING_ATTENTION in types and (self.model_type != "gpt_oss" or self.sliding_window <= 0):
            raise ValueError(
                "TargetConfig: sliding_attention layers need model_type gpt_oss and sliding_window > 0 "
                f"(got {self.model_type}, sliding_window={self.sliding_window})"
            )
        self._check_moe()
        if self.is_hybrid:
            for name in (
                "linear_num_key_heads",
                "linear_num_value_heads",
                "linear_key_head_dim",
                "linear_value_head_dim",
                "linear_conv_kernel_dim",
            ):
                if int(getattr(self, name)) <= 0:
                    raise ValueError(f"TargetConfig.{name} must be positive for {self.model_type}")
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise ValueError(
                    f"TargetConfig: linear_num_value_heads={self.linear_num_value_heads} is not a multiple "
                    f"of linear_num_key_heads={self.linear_num_key_heads}"
                )
        elif LINEAR_ATTENTION in types:
            raise ValueError(
                f"TargetConfig: linear_attention layers need model_type qwen3_5, not {self.model_type}"
            )

    def _check_moe(self):
        if self.moe_matmul not in MOE_MATMULS:
            raise ValueError(
                f"TargetConfig.moe_matmul must be one of {', '.join(MOE_MATMULS)}, got {self.moe_matmul!r}"
            )
        if isinstance(self.moe_tile, bool) or not isinstance(self.moe_tile, int) or self.moe_tile < 1:
            raise ValueError(f"TargetConfig.moe_tile must be an int >= 1, got {self.moe_tile!r}")
        moe = tuple(int(i) for i in self.moe_layers)
        object.__setattr__(self, "moe_layers", moe)
        if self.model_type not in MOE_MODEL_TYPES:
            if self.num_experts or moe:
                raise ValueError(f"TargetConfig: experts need a MoE model_type, not {self.model_type}")
        else:
            if self.num_experts <= 0 or not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"TargetConfig ({self.model_type}): need 0 < num_experts_per_tok="
                    f"{self.num_experts_per_tok} <= num_experts={self.num_experts}"
                )
            if self.moe_intermediate_size <= 0:
                raise ValueError(f"TargetConfig.moe_intermediate_size must be positive for {self.model_type}")
            if list(moe) != sorted(set(moe)) or any(not 0 <= i < self.num_layers for i in moe):
                raise ValueError(f"TargetConfig.moe_layers must be distinct sorted layer ids, got {moe}")
        if self.model_type == "gpt_oss" and self.intermediate_size != self.moe_intermediate_size:
            raise ValueError(
                f"TargetConfig (gpt_oss): intermediate_size={self.intermediate_size} must equal "
                f"moe_intermediate_size={self.moe_intermediate_size} (config.json has one width)"
            )
        if self.model_type == "qwen3_5_moe" and self.shared_expert_intermediate_size <= 0:
            raise ValueError("TargetConfig.shared_expert_intermediate_size must be positive for qwen3_5_moe")
        if len(moe) < self.num_layers and self.intermediate_size <= 0:
            raise ValueError(
                f"TargetConfig.intermediate_size must be positive (dense MLP layers), got {self.intermediate_size}"
            )

    @property
    def is_hybrid(self) -> bool:
        """Qwen3.5 family: (1 + w) RMSNorms, gated attention, Gated DeltaNet layers."""
        return self.model_type in HYBRID_MODEL_TYPES

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def mlp_kinds(self) -> tuple[str, ...]:
        """Per layer: ``moe`` (the MoE block) or ``dense`` (a SwiGLU MLP)."""
        moe = set(self.moe_layers)
        return tuple(MOE_MLP if i in moe else DENSE_MLP for i in range(self.num_layers))

    @property
    def dense_mlp_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.mlp_kinds) if k == DENSE_MLP)

    @property
    def expert_biases(self) -> bool:
        """gpt-oss: biases on the router and on every expert projection."""
        return self.model_type == "gpt_oss"

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def attention_windows(self) -> tuple[int, ...]:
        """Per layer: how many keys back a query sees (sliding_window), 0 = unlimited."""
        return tuple(self.sliding_window if t == SLIDING_ATTENTION else 0 for t in self.layer_types)

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def num_hidden_layers(self) -> int:  # HF spelling
        return self.num_layers

    @classmethod
    def from_hf_dict(cls, hf: dict) -> TargetConfig:
        hf_type = hf.get("model_type")
        if hf_type not in _HF_MODEL_TYPES:
            hint = (
                " (of the Qwen3 hybrids only the Qwen3.5/3.6 families qwen3_5 and qwen3_5_moe are implemented)"
                if str(hf_type).startswith("qwen3_")
                else ""
            )
            raise ValueError(
                f"unsupported model_type {hf_type!r} in config.json{hint}; "
                f"supported: {', '.join(_HF_MODEL_TYPES)}"
            )
        if hf_type in _VL_WRAPPERS:
            if not isinstance(hf.get("text_config"), dict):
                raise ValueError(f"config.json ({hf_type}) is missing its 'text_config'")
            outer = hf
            hf = dict(hf["text_config"])
            for key in (
                "tie_word_embeddings",
                "eos_token_id",
                "pad_token_id",
                "bos_token_id",
                "quantization_config",
            ):
                if hf.get(key) is None and outer.get(key) is not None:
                    hf[key] = outer[key]
            if "tie_word_embeddings" in outer:  # the wrapper's flag decides lm_head tying
                hf["tie_word_embeddings"] = outer["tie_word_embeddings"]
        model_type = _HF_MODEL_TYPES[hf_type]
        _reject_unsupported_features(hf, model_type)

        def need(key):
            if key not in hf:
                raise ValueError(f"config.json ({model_type}) is missing required field {key!r}")
            return hf[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        head_dim = hf.get("head_dim") or hidden // heads
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        attention_bias = bool(hf.get("attention_bias", False))
        hybrid = {}
        if model_type in HYBRID_MODEL_TYPES:
            layers = int(need("num_hidden_layers"))
            interval = int(hf.get("full_attention_interval", 4))
            types = hf.get("layer_types") or [
                FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(layers)
            ]
            rope_params = hf.get("rope_parameters") or {}
            hybrid = dict(
                layer_types=tuple(types),
                linear_num_key_heads=int(hf.get("linear_num_key_heads", 16)),
                linear_num_value_heads=int(hf.get("linear_num_value_heads", 32)),
                linear_key_head_dim=int(hf.get("linear_key_head_dim", 128)),
                linear_value_head_dim=int(hf.get("linear_value_head_dim", 128)),
                linear_conv_kernel_dim=int(hf.get("linear_conv_kernel_dim", 4)),
                partial_rotary_factor=float(
                    rope_params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
                ),
            )
            head_dim = hf.get("head_dim") or 256
        moe = _moe_fields(hf, model_type, int(need("num_hidden_layers")), need)
        if model_type == "gpt_oss":
            attention_bias = bool(hf.get("attention_bias", True))
        return cls(
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(
                hf.get("intermediate_size") or 0 if model_type == "qwen3_5_moe" else need("intermediate_size")
            ),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(hf),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=True if model_type == "qwen2" else attention_bias,
            o_proj_bias=attention_bias if model_type in ("llama", "gpt_oss") else False,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_5", "qwen3_moe", "qwen3_5_moe"),
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            pad_token_id=hf.get("pad_token_id"),
            **hybrid,
            **moe,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> TargetConfig:
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"no config.json in target directory {path}")
        try:
            hf = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_file}: invalid JSON ({e})") from e
        return cls.from_hf_dict(hf)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["rope"] = asdict(self.rope)
        d["layer_types"] = list(self.layer_types)
        d["moe_layers"] = list(self.moe_layers)
        return d

    def to_hf_dict(self) -> dict:
        """A transformers ``config.json`` for this architecture (the text-only form for qwen3_5)."""
        c = self
        if c.is_hybrid:
            moe = c.model_type == "qwen3_5_moe"
            hf = {
                "architectures": ["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"],
                "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
                "layer_types": list(c.layer_types),
                "linear_num_key_heads": c.linear_num_key_heads,
                "linear_num_value_heads": c.linear_num_value_heads,
                "linear_key_head_dim": c.linear_key_head_dim,
                "linear_value_head_dim": c.linear_value_head_dim,
                "linear_conv_kernel_dim": c.linear_conv_kernel_dim,
                "rope_parameters": {**c.rope.to_hf(), "partial_rotary_factor": c.partial_rotary_factor},
            }
            if moe:
                hf.update(
                    num_experts=c.num_experts,
                    num_experts_per_tok=c.num_experts_per_tok,
                    moe_intermediate_size=c.moe_intermediate_size,
                    shared_expert_intermediate_size=c.shared_expert_intermediate_size,
                )
        elif c.model_type == "qwen3_moe":
            sparse = set(c.moe_layers)
            hf = {
                "architectures": ["Qwen3MoeForCausalLM"],
                "model_type": "qwen3_moe",
                "rope_parameters": c.rope.to_hf(),
                "attention_bias": c.attention_bias,
                "num_experts": c.num_experts,
                "num_experts_per_tok": c.num_experts_per_tok,
                "moe_intermediate_size": c.moe_intermediate_size,
                "norm_topk_prob": c.norm_topk_prob,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [i for i in range(c.num_layers) if i not in sparse],
            }
        elif c.model_type == "gpt_oss":
            hf = {
                "architectures": ["GptOssForCausalLM"],
                "model_type": "gpt_oss",
                "rope_parameters": c.rope.to_hf(),
                "attention_bias": c.attention_bias,
                "layer_types": list(c.layer_types),
                "sliding_window": c.sliding_window,
                "num_local_experts": c.num_experts,
                "num_experts_per_tok": c.num_experts_per_tok,
                "swiglu_limit": c.swiglu_limit,
                "swiglu_alpha": c.swiglu_alpha,
            }
        else:
            arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
            hf = {
                "architectures": [arch[c.model_type]],
                "model_type": c.model_type,
                "rope_parameters": c.rope.to_hf(),
                "attention_bias": c.attention_bias if c.model_type != "qwen2" else True,
                "mlp_bias": c.mlp_bias,
            }
        eos = list(c.eos_token_ids)
        hf.update(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            num_hidden_layers=c.num_layers,
            num_attention_heads=c.num_heads,
            num_key_value_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            rms_norm_eps=c.rms_norm_eps,
            tie_word_embeddings=c.tie_word_embeddings,
            max_position_embeddings=c.max_position_embeddings,
            hidden_act="silu",
            bos_token_id=c.bos_token_id,
            eos_token_id=eos[0] if len(eos) == 1 else (eos or None),
            pad_token_id=c.pad_token_id,
        )
        if c.model_type == "gpt_oss":  # gpt-oss's intermediate_size is the experts' width
            hf["intermediate_size"] = c.moe_intermediate_size
        elif c.intermediate_size:
            hf["intermediate_size"] = c.intermediate_size
        return hf


def _moe_fields(hf: dict, model_type: str, num_layers: int, need) -> dict:
    """The TargetConfig MoE fields of a config.json (empty for dense families)."""
    if model_type not in MOE_MODEL_TYPES:
        return {}
    experts = int(hf.get("num_local_experts") or need("num_experts"))
    out = dict(
        num_experts=experts,
        num_experts_per_tok=int(need("num_experts_per_tok")),
        moe_intermediate_size=int(
            hf["intermediate_size"] if model_type == "gpt_oss" else need("moe_intermediate_size")
        ),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)) or model_type == "qwen3_5_moe",
        moe_layers=tuple(range(num_layers)),
    )
    if model_type == "qwen3_moe":
        step = int(hf.get("decoder_sparse_step", 1) or 1)
        dense = set(int(i) for i in hf.get("mlp_only_layers") or ())
        out["moe_layers"] = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    elif model_type == "qwen3_5_moe":
        out["shared_expert_intermediate_size"] = int(need("shared_expert_intermediate_size"))
    else:  # gpt_oss
        types = hf.get("layer_types") or [
            SLIDING_ATTENTION if (i + 1) % 2 else FULL_ATTENTION for i in range(num_layers)
        ]
        out.update(
            layer_types=tuple(types),
            sliding_window=int(hf.get("sliding_window") or 0),
            swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
            swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
            attention_sinks=True,
        )
    return out


def _reject_unsupported_features(hf: dict, model_type: str) -> None:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json: unsupported hidden_act {act!r} (only 'silu' SwiGLU MLPs)")
    if model_type in HYBRID_MODEL_TYPES:
        if hf.get("attention_bias", False):
            raise ValueError(f"config.json ({model_type}): attention_bias=true is not supported")
        rope_type = (hf.get("rope_parameters") or {}).get("rope_type", "default")
        if rope_type != "default":
            raise ValueError(
                f"config.json ({model_type}): unsupported rope_type {rope_type!r} (only 'default')"
            )
        if model_type == "qwen3_5" and hf.get("num_experts"):
            raise ValueError(
                "config.json (qwen3_5): num_experts is set; a MoE checkpoint has model_type qwen3_5_moe"
            )
        types = hf.get("layer_types") or []
        bad = sorted(set(types) - {FULL_ATTENTION, LINEAR_ATTENTION})
        if bad:
            raise ValueError(f"config.json ({model_type}): unsupported layer_types {bad}")
    elif model_type == "gpt_oss":
        bad = sorted(set(hf.get("layer_types") or []) - {FULL_ATTENTION, SLIDING_ATTENTION})
        if bad:
            raise ValueError(f"config.json (gpt_oss): unsupported layer_types {bad}")
    elif model_type in ("qwen2", "qwen3", "qwen3_moe") and hf.get("use_sliding_window", False):
        raise ValueError("config.json: use_sliding_window=true is not supported for target models")
    layer_types = hf.get("layer_types")
    if (
        model_type not in (*HYBRID_MODEL_TYPES, "gpt_oss")
        and layer_types
        and any(t != "full_attention" for t in layer_types)
        and hf.get("use_sliding_window", False)
    ):
        raise ValueError(f"config.json: unsupported layer_types {sorted(set(layer_types))}")
    if hf.get("pretraining_tp", 1) not in (1, None):
        raise ValueError("config.json: pretraining_tp != 1 is not supported")
    quant = hf.get("quantization_config")
    if quant and not (model_type == "gpt_oss" and quant.get("quant_method") == "mxfp4"):
        raise ValueError(
            f"config.json: quantized checkpoints are not supported ({quant.get('quant_method')})"
        )


def qkv_channel_order(c: TargetConfig) -> tuple[int, ...]:
    """Our conv channel j holds HF's channel order[j].

    HF fuses the DeltaNet q | k | v channels head by head within each part (all q heads, then all
    k heads, then all v heads). We group them by key head instead: [q_h ; k_h ; v of the value
    heads h*r .. h*r+r-1] for h = 0 .. Hk-1 (r = Hv / Hk), so splitting the channels evenly over
    the ``tensor`` axis gives each device whole groups, consistent with the head-split z, beta,
    decay and out_proj (the depthwise conv acts per channel, so any order computes the same)."""
    Hk, Dk, Dv = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim
    r = c.linear_num_value_heads // Hk
    order = []
    for h in range(Hk):
        order += range(h * Dk, (h + 1) * Dk)  # q
        order += range(Hk * Dk + h * Dk, Hk * Dk + (h + 1) * Dk)  # k
        order += range(2 * Hk * Dk + h * r * Dv, 2 * Hk * Dk + (h + 1) * r * Dv)  # v
    return tuple(order)
