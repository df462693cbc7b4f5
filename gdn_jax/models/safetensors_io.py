"""A dependency-free reader of HF safetensors checkpoints (single file or sharded with its
``model.safetensors.index.json``), memory-mapped, every dtype numpy + ml_dtypes can hold (bf16
and fp8 included, which the ``safetensors`` numpy API does not cover)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {
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


def read_header(path: Path) -> tuple[int, dict]:
    """``(data start offset, header dict)`` of one ``.safetensors`` file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return 8 + n, header


class Checkpoint:
    """Tensor names, shapes and lazily memory-mapped values of a checkpoint directory."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        index = self.directory / "model.safetensors.index.json"
        if index.exists():
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = sorted(p.name for p in self.directory.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {self.directory}")
        self._entries: dict[str, tuple[Path, int, dict]] = {}
        for name in files:
            path = self.directory / name
            start, header = read_header(path)
            for key, entry in header.items():
                self._entries[key] = (path, start, entry)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        return sorted(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name][2]["shape"])

    def get(self, name: str) -> np.ndarray:
        path, start, entry = self._entries[name]
        if entry["dtype"] not in DTYPES:
            raise ValueError(f"{name}: unsupported safetensors dtype {entry['dtype']}")
        dtype = np.dtype(DTYPES[entry["dtype"]])
        begin, end = entry["data_offsets"]
        raw = np.memmap(path, dtype=np.uint8, mode="r", offset=start + begin, shape=(end - begin,))
        return raw.view(dtype).reshape(entry["shape"])


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray]) -> None:
    """Writes numpy arrays as one ``.safetensors`` file (tests and tools)."""
    names = {np.dtype(v): k for k, v in DTYPES.items()}
    header, offset, blobs = {}, 0, []
    for key, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        blob = arr.tobytes()
        header[key] = {
            "dtype": names[arr.dtype],
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        offset += len(blob)
        blobs.append(blob)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for blob in blobs:
            f.write(blob)
