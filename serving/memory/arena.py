"""The device arena: one preallocated ``uint32`` buffer ``[num_segments, segment_words]``.

Every update goes through a jitted function that donates the buffer, so XLA writes in place and
the arena is never duplicated (checked by the ``jax.live_arrays()`` test). Units of any dtype
live in it as bitcast views: a field of ``n`` elements of a 2-byte dtype occupies ``ceil(n/2)``
words, read as ``bitcast(words) -> [words, 2] -> [:n] -> shape``.

Addresses are ``(segment, word)`` pairs of int32: a 2-D buffer keeps both indices far below
2**31 even for arenas of hundreds of GiB, which a flat int32 index could not reach.
"""

from __future__ import annotations

import functools
import math

import jax
import numpy as np
from jax import lax
from jax import numpy as jnp

from serving.memory.layout import WORD_BYTES, Field


def words_to_field(raw: jax.Array, shape: tuple[int, ...], dtype: np.dtype) -> jax.Array:
    """Reinterpret ``uint32`` words ``raw [w]`` as an array of ``shape`` and ``dtype``."""
    dtype = np.dtype(dtype)
    if dtype.itemsize > WORD_BYTES:
        raise ValueError(f"dtype {dtype} is wider than a 4-byte arena word")
    out = lax.bitcast_convert_type(raw, dtype)  # [w] or [w, 4 // itemsize]
    return out.reshape(-1)[: math.prod(shape)].reshape(shape)


def field_to_words(value: jax.Array) -> jax.Array:
    """Inverse of :func:`words_to_field`: the bits of ``value`` as ``uint32`` words."""
    ratio = WORD_BYTES // value.dtype.itemsize
    flat = value.reshape(-1)
    if ratio == 1:
        return lax.bitcast_convert_type(flat, jnp.uint32)
    pad = (-flat.shape[0]) % ratio
    flat = jnp.pad(flat, (0, pad))
    return lax.bitcast_convert_type(flat.reshape(-1, ratio), jnp.uint32)


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "words"))
def _read_field(buf, seg, word, *, shape, dtype, words):
    raw = lax.dynamic_slice(buf, (seg, word), (1, words))[0]
    return words_to_field(raw, shape, dtype)


@functools.partial(jax.jit, donate_argnums=0)
def _write_words(buf, seg, word, value):
    return lax.dynamic_update_slice(buf, field_to_words(value)[None], (seg, word))


@functools.partial(jax.jit, donate_argnums=0, static_argnames=("words",))
def _move_units(buf, moves, count, *, words):
    """Copy ``count`` units of ``words`` words: ``moves[i] = (src_seg, src_w, dst_seg, dst_w)``.

    Sources and destinations never overlap (a compaction moves live units out of the segments
    it evacuates into free units of segments it keeps), so the order of the copies is free.
    """

    def body(i, b):
        m = moves[i]
        unit = lax.dynamic_slice(b, (m[0], m[1]), (1, words))
        return lax.dynamic_update_slice(b, unit, (m[2], m[3]))

    return lax.fori_loop(0, count, body, buf)


def view(buffer: jax.Array, table: jax.Array, handle: jax.Array, field: Field) -> jax.Array:
    """Jittable read of one field of ``handle`` through the device table ``[H, 2]`` int32.

    This is how kernels address the arena: the handle is data (a traced int32), the field
    layout is static; no gather into a new per-layer buffer happens.
    """
    seg, word = table[handle, 0], table[handle, 1] + field.word_offset
    raw = lax.dynamic_slice(buffer, (seg, word), (1, field.words))[0]
    return words_to_field(raw, field.shape, field.dtype)


class Arena:
    """One device buffer of ``num_segments * segment_words`` words, updated in place."""

    def __init__(self, num_segments: int, segment_words: int, device: jax.Device | None = None):
        if num_segments < 1 or segment_words < 1:
            raise ValueError(
                f"arena needs >= 1 segment of >= 1 word, got {num_segments} x {segment_words}")
        self.num_segments = num_segments
        self.segment_words = segment_words
        self.buffer = jnp.zeros((num_segments, segment_words), jnp.uint32, device=device)

    @property
    def nbytes(self) -> int:
        return self.num_segments * self.segment_words * WORD_BYTES

    def read(self, seg: int, word: int, field: Field) -> jax.Array:
        return _read_field(self.buffer, np.int32(seg), np.int32(word + field.word_offset),
                           shape=field.shape, dtype=field.dtype, words=field.words)

    def write(self, seg: int, word: int, field: Field, value: jax.Array) -> None:
        self.buffer = _write_words(self.buffer, np.int32(seg),
                                   np.int32(word + field.word_offset), value)

    def read_words(self, seg: int, word: int, words: int) -> jax.Array:
        return _read_field(self.buffer, np.int32(seg), np.int32(word), shape=(words,),
                           dtype=np.dtype(np.uint32), words=words)

    def move(self, moves: list[tuple[int, int, int, int]], words: int) -> None:
        """Copy units of ``words`` words on device, one jitted call for the whole batch."""
        if not moves:
            return
        # Pad to a power of two so a handful of compiled programs serve every batch size.
        size = 1 << (len(moves) - 1).bit_length()
        table = np.zeros((size, 4), np.int32)
        table[: len(moves)] = moves
        self.buffer = _move_units(self.buffer, table, np.int32(len(moves)), words=words)
