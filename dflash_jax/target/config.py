"""TargetConfig: the frozen target LLM's architecture, read from an HF ``config.json``.

One decoder-only implementation covers Llama, Qwen2 (qkv bias) and Qwen3 (q/k RMSNorm). Anything
we do not implement is rejected here with the offending field named, never approximated.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dflash_jax.layers import RopeConfig

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


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

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {self.model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
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
        if self.head_dim % 2:
            raise ValueError(f"TargetConfig.head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def num_hidden_layers(self) -> int:  # HF spelling
        return self.num_layers

    @classmethod
    def from_hf_dict(cls, hf: dict) -> TargetConfig:
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            hint = (
                " (Qwen3.5/3.6 hybrid linear attention is not implemented yet)"
                if str(model_type).startswith("qwen3_")
                else ""
            )
            raise ValueError(
                f"unsupported model_type {model_type!r} in config.json{hint}; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
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
        return cls(
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(hf),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=True if model_type == "qwen2" else attention_bias,
            o_proj_bias=attention_bias if model_type == "llama" else False,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            pad_token_id=hf.get("pad_token_id"),
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
        return d


def _reject_unsupported_features(hf: dict, model_type: str) -> None:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json: unsupported hidden_act {act!r} (only 'silu' SwiGLU MLPs)")
    if model_type in ("qwen2", "qwen3") and hf.get("use_sliding_window", False):
        raise ValueError("config.json: use_sliding_window=true is not supported for target models")
    layer_types = hf.get("layer_types")
    if (
        layer_types
        and any(t != "full_attention" for t in layer_types)
        and hf.get("use_sliding_window", False)
    ):
        raise ValueError(f"config.json: unsupported layer_types {sorted(set(layer_types))}")
    if hf.get("pretraining_tp", 1) not in (1, None):
        raise ValueError("config.json: pretraining_tp != 1 is not supported")
    quant = hf.get("quantization_config")
    if quant:
        raise ValueError(
            f"config.json: quantized checkpoints are not supported ({quant.get('quant_method')})"
        )
