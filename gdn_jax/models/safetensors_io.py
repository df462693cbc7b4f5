"""HF safetensors checkpoints (one file, or sharded with ``model.safetensors.index.json``)
through the ``safetensors`` package's numpy reader, bf16 included (``ml_dtypes`` registers the
dtype with numpy). A file that is not a readable safetensors file, or an index that is not
valid JSON, raises :class:`CheckpointError` naming the file."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, which the reader needs)
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

# The dtypes the numpy reader returns; FP8 (F8_E4M3, F8_E5M2) is not among them.
READABLE = ("F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not match its config: an unreadable file, a
    missing or misshapen tensor."""


def _open(path: Path):
    try:
        return safe_open(str(path), framework="numpy")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


class Checkpoint:
    """Tensor names, shapes and values of a checkpoint directory; each tensor is read from its
    file when asked for."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        index = self.directory / "model.safetensors.index.json"
        if index.exists():
            try:
                files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(
                    f"{index}: not a safetensors index (a JSON object with a 'weight_map'): {e}"
                ) from None
        else:
            files = sorted(p.name for p in self.directory.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {self.directory}")
        self._files: dict[Path, object] = {}
        self._entries: dict[str, Path] = {}
        for name in files:
            path = self.directory / name
            if not path.is_file():
                raise CheckpointError(f"{path}: listed in {index.name} but missing")
            handle = _open(path)
            self._files[path] = handle
            for key in handle.keys():
                self._entries[key] = path

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        return sorted(self._entries)

    def _slice(self, name: str):
        return self._files[self._entries[name]].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def get(self, name: str) -> np.ndarray:
        path = self._entries[name]
        dtype = self._slice(name).get_dtype()
        if dtype not in READABLE:
            raise CheckpointError(f"{name} in {path}: unsupported safetensors dtype {dtype}")
        try:
            return self._files[path].get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{name} in {path}: cannot be read ({e})") from None


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray]) -> None:
    """Writes numpy arrays (bf16 included) as one ``.safetensors`` file."""
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path))
