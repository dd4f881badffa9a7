"""Chat data -> tokenised, loss-masked, packed batches.

  sources   ShareGPT / OpenAI-style JSON and JSONL, parquet / Arrow / save_to_disk / hf: tables,
            pre-tokenized rows, the packaged ShareGPT V3 (streamed), bad-record policy,
            ``write_chat_jsonl`` / ``read_chat_jsonl``
  chat      ``tokenize_conversation``: the target's chat template (tools too), loss mask on the replies
  packing   first-fit packing into ``[rows, max_length]`` with segment ids and positions
  splits    held-out conversations for evaluation (by seed, before any shuffle)
  pipeline  ``DataConfig``, ``make_train_iterator``, ``load_heldout_prompts``, ``to_global_batch``

Names are resolved lazily so importing this package does not import grain or numpy.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "DataConfig": "dflash_jax.data.pipeline",
    "DataReport": "dflash_jax.data.pipeline",
    "build_train_dataset": "dflash_jax.data.pipeline",
    "make_train_iterator": "dflash_jax.data.pipeline",
    "load_heldout_prompts": "dflash_jax.data.pipeline",
    "to_global_batch": "dflash_jax.data.pipeline",
    "tokenize_conversation": "dflash_jax.data.chat",
    "ChatTemplateError": "dflash_jax.data.chat",
    "BadRecordError": "dflash_jax.data.sources",
    "index_sources": "dflash_jax.data.sources",
    "read_chat_jsonl": "dflash_jax.data.sources",
    "write_chat_jsonl": "dflash_jax.data.sources",
    "unpack_documents": "dflash_jax.data.packing",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'dflash_jax.data' has no attribute {name!r}")
