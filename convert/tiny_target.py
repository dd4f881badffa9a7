"""The ``target.path: tiny`` directory: the random tiny target of ``dflash_jax.target.tiny`` saved
as an HF checkpoint (config.json + model.safetensors), so every tool loads it like a real one."""

from __future__ import annotations

import json
from pathlib import Path

from convert.hf_target import export_target_state
from dflash_jax.target.tiny import build_tiny_target, tiny_hf_config, tiny_target_key


def make_tiny_target_dir(section, vocab_size: int, root: Path) -> Path:
    """``root/<tiny_target_key>``: made once per shape, reused only for the same shape."""
    from safetensors.numpy import save_file

    directory = Path(root) / tiny_target_key(section, vocab_size)
    marker = directory / "config.json"
    if marker.is_file():
        return directory
    model = build_tiny_target(section, vocab_size)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(export_target_state(model), directory / "model.safetensors", metadata={"format": "pt"})
    marker.write_text(json.dumps(tiny_hf_config(section, vocab_size), indent=2))  # last: the marker
    return directory
