"""The vllm-project/speculators DFlash layout, both directions: our ``DrafterConfig`` <-> its
config.json (the tensors are z-lab's, see ``convert.zlab_drafter``).

vLLM serves it with ``method: "dflash"``: ``speculators_model_type: "dflash"``, the draft decoder in
``transformer_layer_config``, ``speculators_config`` with a greedy proposal of ``block_size - 1``
tokens and the verifier (the target) it drafts for. Its ``aux_hidden_state_layer_ids`` count layers
the way vLLM's EAGLE-3 hooks do, one more than z-lab's ``target_layer_ids`` (vLLM maps them back
with ``target_layer_ids = aux - 1``). It does not record the target's depth: the import takes it
from ``transformer_layer_config.num_target_layers`` (our export writes it), else from the
verifier's config.json when that path exists, else from the caller.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from convert.zlab_drafter import CONFIG_FILE, write_hf_drafter
from dflash_jax.drafter.config import FULL_ATTENTION, SLIDING_ATTENTION, DrafterConfig
from dflash_jax.dtypes import to_dtype

# Top-level keys that mark a config.json as the speculators layout.
MARKER_KEY = "speculators_model_type"
# A reduced draft vocabulary's tensors (speculators' DraftVocabMixin buffers, and the N rows of the
# verifier's lm_head it keeps serialised because runtimes do not derive them).
T2D_KEY, D2T_KEY, LM_HEAD_KEY = "t2d", "d2t", "lm_head.weight"
VOCAB_TENSOR_KEYS = (T2D_KEY, D2T_KEY, LM_HEAD_KEY)


def vocab_mappings(draft_vocab, vocab_size: int) -> dict[str, np.ndarray]:
    """Ascending draft-vocabulary target ids [N] -> speculators' ``t2d`` (bool [V]: in the draft
    vocabulary) and ``d2t`` (int64 [N]: target id = draft index + d2t)."""
    ids = np.asarray(draft_vocab, np.int64)
    t2d = np.zeros(vocab_size, bool)
    t2d[ids] = True
    return {T2D_KEY: t2d, D2T_KEY: ids - np.arange(ids.size, dtype=np.int64)}


def draft_vocab_of(t2d, d2t, *, draft_vocab_size: int, vocab_size: int) -> np.ndarray:
    """speculators' ``t2d``/``d2t`` -> the draft vocabulary's target ids (int32 [N], ascending),
    checked against each other and the config's sizes."""
    t2d, d2t = np.asarray(t2d).astype(bool), np.asarray(d2t).astype(np.int64)
    if t2d.shape != (vocab_size,) or d2t.shape != (draft_vocab_size,):
        raise ValueError(
            f"speculators drafter: t2d {list(t2d.shape)} / d2t {list(d2t.shape)} do not match vocab_size="
            f"{vocab_size} / draft_vocab_size={draft_vocab_size}"
        )
    ids = np.arange(draft_vocab_size, dtype=np.int64) + d2t
    if ids.min() < 0 or ids.max() >= vocab_size or np.any(np.diff(ids) <= 0):
        raise ValueError("speculators drafter: d2t does not map draft indices to ascending target ids")
    if int(t2d.sum()) != draft_vocab_size or not np.all(t2d[ids]):
        raise ValueError("speculators drafter: t2d does not mark exactly the target ids d2t maps to")
    return ids.astype(np.int32)


def verifier_lm_head_rows(verifier: str | Path, ids, dtype: str) -> np.ndarray:
    """The rows ``ids`` of the verifier's lm_head ([N, D], ``dtype``), read from its directory
    (the tied embedding when it has no lm_head)."""
    from convert.safetensors_io import CheckpointReader

    path = Path(verifier)
    if not path.is_dir():
        raise ValueError(
            f"a reduced-vocabulary speculators export keeps the verifier's lm_head rows, but the verifier "
            f"{verifier} is not a local directory: pass --verifier TARGET_DIR"
        )
    reader = CheckpointReader(path)
    for key in ("lm_head.weight", "model.embed_tokens.weight", "model.language_model.embed_tokens.weight"):
        if key in reader.keys():
            return np.asarray(reader.get(key))[np.asarray(ids)].astype(to_dtype(dtype))
    raise ValueError(f"verifier {path}: no lm_head.weight or embed_tokens weight to take the draft rows from")


def _decoder_dict(config: DrafterConfig) -> dict:
    """The Qwen3 decoder fields of our z-lab config (what speculators' transformer_layer_config holds)."""
    z = config.replace(draft_vocab_size=None).to_hf_dict()
    drop = ("architectures", "block_size", "dflash_config", "is_causal")
    return {k: v for k, v in z.items() if k not in drop}


def speculators_config(
    config: DrafterConfig, *, dtype: str | None = None, verifier: str | Path | None = None
) -> dict:
    """The config.json of a vllm-project/speculators DFlash drafter (see module doc)."""
    if config.embedding_scale != 1.0 or config.logit_scale != 1.0 or config.logit_softcap is not None:
        raise ValueError(
            "the speculators format has no input_embedding_scale / output_multiplier / final_logit_softcapping; "
            "export this drafter with --format zlab"
        )
    sliding = SLIDING_ATTENTION in config.layer_types
    if config.causal_in_block is True and FULL_ATTENTION in config.layer_types:
        raise ValueError(
            "causal_in_block=True on full-attention layers cannot be expressed in the speculators format "
            "(its full-attention layers are always bidirectional); export with --format zlab"
        )
    non_causal = config.causal_in_block is False  # None: z-lab's rule = sliding layers causal
    decoder = _decoder_dict(config)
    if dtype is not None:
        decoder["dtype"] = dtype
    verifier_cfg = {"name_or_path": None, "architectures": []}
    if verifier is not None:
        verifier_cfg["name_or_path"] = str(verifier)
        vcfg = Path(verifier) / CONFIG_FILE
        if vcfg.is_file():
            verifier_cfg["architectures"] = list(json.loads(vcfg.read_text()).get("architectures") or [])
    out = {
        "architectures": ["DFlashDraftModel"],
        "speculators_model_type": "dflash",
        "transformer_layer_config": decoder,
        "draft_vocab_size": config.head_size,
        "target_hidden_size": config.hidden_size,
        "block_size": config.block_size,
        # vLLM's convention: aux id = z-lab target_layer_id + 1 (it maps back with aux - 1).
        "aux_hidden_state_layer_ids": [i + 1 for i in config.target_layer_ids],
        "mask_token_id": config.mask_token_id,
        "sliding_window_non_causal": non_causal,
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": config.block_size - 1}],
            "default_proposal_method": "greedy",
            "verifier": verifier_cfg,
        },
    }
    if sliding:  # newer vLLM reads the window layout at the top level as well
        for key in ("layer_types", "use_sliding_window", "sliding_window", "max_window_layers"):
            out[key] = decoder[key]
    if dtype is not None:
        out["dtype"] = dtype
    return out


def write_speculators_drafter(
    path: str | Path, config: DrafterConfig, params: dict, dtype: str = "bfloat16", verifier=None
) -> Path:
    """A speculators drafter dir; with a draft vocabulary also ``t2d``, ``d2t`` and the verifier's
    lm_head rows (read from ``verifier``, which must then be a local directory)."""
    cfg = speculators_config(config, dtype=dtype, verifier=verifier)
    params = dict(params)
    vocab = params.pop("draft_vocab", None)
    extra = None
    if config.draft_vocab_size is not None:
        if vocab is None:
            raise ValueError(f"draft_vocab_size={config.draft_vocab_size} but the params hold no draft_vocab")
        extra = vocab_mappings(vocab, config.vocab_size)
        extra[LM_HEAD_KEY] = verifier_lm_head_rows(verifier, vocab, dtype)
    return write_hf_drafter(path, config, params, dtype, cfg, extra)


def verifier_of(cfg: dict) -> str | None:
    """The verifier (target) name or path a speculators config.json records, if any."""
    return ((cfg.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")


def draft_vocab_size_of(cfg: dict) -> int | None:
    """A speculators config's reduced draft vocabulary size (None: the verifier's whole vocabulary)."""
    n, vocab = cfg.get("draft_vocab_size"), (cfg.get("transformer_layer_config") or {}).get("vocab_size")
    return None if n is None or n == vocab else int(n)


def speculators_to_zlab(cfg: dict, *, num_target_layers: int | None = None) -> dict:
    """A speculators DFlash config.json dict -> the equivalent z-lab config dict (its draft
    vocabulary size, if reduced, is ``draft_vocab_size_of(cfg)``: z-lab's format has none)."""
    if cfg.get(MARKER_KEY) != "dflash":
        raise ValueError(
            f"speculators config: speculators_model_type={cfg.get(MARKER_KEY)!r}; only 'dflash' is supported"
        )
    for key in ("transformer_layer_config", "aux_hidden_state_layer_ids", "mask_token_id"):
        if cfg.get(key) is None:
            raise ValueError(f"speculators config: missing {key!r}")
    if cfg.get("projector_type", "dflash") != "dflash":
        raise ValueError(f"speculators config: projector_type={cfg['projector_type']!r} is not supported")
    decoder = dict(cfg["transformer_layer_config"])
    for key in ("layer_types", "use_sliding_window", "sliding_window", "max_window_layers"):
        if key in cfg:
            decoder[key] = cfg[key]
    n_target = decoder.pop("num_target_layers", None) or cfg.get("num_target_layers") or num_target_layers
    if n_target is None:
        verifier = verifier_of(cfg)
        vcfg = Path(verifier) / CONFIG_FILE if verifier else None
        if vcfg is not None and vcfg.is_file():
            v = json.loads(vcfg.read_text())
            n_target = v.get("num_hidden_layers") or (v.get("text_config") or {}).get("num_hidden_layers")
    if n_target is None:
        raise ValueError(
            "speculators config does not record the target's number of layers: pass --num-target-layers"
        )
    non_causal = bool(cfg.get("sliding_window_non_causal", False))
    out = dict(decoder)
    out.update(
        architectures=["DFlashDraftModel"],
        model_type=decoder.get("model_type", "qwen3"),
        num_target_layers=int(n_target),
        block_size=int(cfg.get("block_size", 8)),
        dflash_config={
            "mask_token_id": int(cfg["mask_token_id"]),
            "target_layer_ids": [int(i) - 1 for i in cfg["aux_hidden_state_layer_ids"]],
        },
    )
    if non_causal:
        out["is_causal"] = False
    return out
