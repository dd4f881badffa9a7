"""Tensor-by-tensor safetensors reading (single file or sharded index) without loading a whole model.

Files are memory-mapped and each tensor is materialised only when asked for, so a loader can move
one tensor at a time onto the device mesh. bf16/fp8 come through ``ml_dtypes``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


class CorruptCheckpointError(ValueError):
    pass


class SafetensorsFile:
    """One .safetensors file: header parsed eagerly, tensors read lazily through a memmap."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CorruptCheckpointError(f"{self.path}: too short to be a safetensors file")
            (header_len,) = struct.unpack("<Q", raw)
            if header_len > size - 8 or header_len > 100 * 2**20:
                raise CorruptCheckpointError(
                    f"{self.path}: corrupt safetensors header (declared length {header_len}, file {size} bytes)"
                )
            try:
                header = json.loads(f.read(header_len))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CorruptCheckpointError(f"{self.path}: corrupt safetensors header ({e})") from e
        self.metadata = header.pop("__metadata__", {}) or {}
        self._data_start = 8 + header_len
        self._entries = header
        data_len = size - self._data_start
        for name, e in header.items():
            if e.get("dtype") not in _DTYPES:
                raise CorruptCheckpointError(
                    f"{self.path}: tensor {name!r} has unsupported dtype {e.get('dtype')}"
                )
            start, end = e["data_offsets"]
            want = int(np.prod(e["shape"], dtype=np.int64)) * np.dtype(_DTYPES[e["dtype"]]).itemsize
            if end > data_len or end - start != want:
                raise CorruptCheckpointError(
                    f"{self.path}: tensor {name!r} data is truncated or inconsistent "
                    f"(offsets {start}..{end}, expected {want} bytes, data section {data_len} bytes)"
                )
        self._mm: np.memmap | None = None

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(_DTYPES[self._entries[name]["dtype"]])

    def get(self, name: str) -> np.ndarray:
        """A read-only view of the tensor backed by the memmap (copy it if you keep it)."""
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        e = self._entries[name]
        start, end = e["data_offsets"]
        buf = self._mm[self._data_start + start : self._data_start + end]
        return buf.view(_DTYPES[e["dtype"]]).reshape(e["shape"])


class CheckpointReader:
    """All tensors of an HF checkpoint directory: ``model.safetensors`` or a sharded index."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        index = self.directory / "model.safetensors.index.json"
        single = self.directory / "model.safetensors"
        self._files: dict[str, SafetensorsFile] = {}
        self._where: dict[str, str] = {}
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CorruptCheckpointError(f"{index}: not a valid safetensors index ({e})") from e
            for name, fname in weight_map.items():
                if not (self.directory / fname).is_file():
                    raise FileNotFoundError(f"{index} maps {name!r} to missing shard {fname}")
                self._where[name] = fname
            for fname in sorted(set(weight_map.values())):
                self._files[fname] = SafetensorsFile(self.directory / fname)
                for key in self._files[fname].keys():
                    if self._where.get(key) != fname:
                        raise CorruptCheckpointError(
                            f"{self.directory / fname}: tensor {key!r} is not listed for this shard in {index.name}"
                        )
            for name, fname in weight_map.items():
                if name not in self._files[fname]._entries:
                    raise CorruptCheckpointError(
                        f"{index} lists {name!r} in {fname}, but that shard lacks it"
                    )
        elif single.is_file():
            self._files[single.name] = SafetensorsFile(single)
            self._where = {k: single.name for k in self._files[single.name].keys()}
        else:
            raise FileNotFoundError(
                f"no model.safetensors or model.safetensors.index.json in {self.directory}"
            )

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return self._files[self._where[name]].shape(name)

    def dtype(self, name: str) -> np.dtype:
        return self._files[self._where[name]].dtype(name)

    def get(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise KeyError(f"tensor {name!r} not found in checkpoint {self.directory}")
        return self._files[self._where[name]].get(name)

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        for name in self._where:
            yield name, self.get(name)
