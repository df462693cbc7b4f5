"""The device arena: one preallocated ``uint32`` buffer ``[num_segments, segment_words]``.

Every update goes through a jitted function that donates the buffer, so XLA writes in place and
the arena is never duplicated (checked by the ``jax.live_arrays()`` test). Units of any dtype
live in it as bitcast views: a field of ``n`` elements of a 2-byte dtype occupies ``ceil(n/2)``
words, read as ``bitcast(words) -> [words, 2] -> [:n] -> shape``.

Addresses are ``(segment, word)`` pairs of int32: a 2-D buffer keeps both indices far below
2**31 even for arenas of hundreds of GiB, which a flat int32 index could not reach.

Jittable access: :func:`view` reads one field of one handle through the device table;
:func:`gather_windows` / :func:`scatter_windows` read / write one window of words per row of a
batch of addresses; :func:`words_to_field` / :func:`field_to_words` convert between words and
typed values; :func:`move_units` copies a batch of units (:func:`move_table` pads the batch).
"""

from __future__ import annotations

import functools
import math

import jax
import numpy as np
from jax import lax
from jax import numpy as jnp

from serving.memory.layout import WORD_BYTES, Field

_MODE = lax.GatherScatterMode.FILL_OR_DROP


def words_to_field(raw: jax.Array, shape: tuple[int, ...], dtype) -> jax.Array:
    """Reinterpret ``uint32`` words ``raw [..., w]`` as ``[..., *shape]`` of ``dtype``: the
    first ``prod(shape)`` elements of their bits, per index of the leading axes."""
    dtype = jnp.dtype(dtype)
    if dtype.itemsize > WORD_BYTES:
        raise ValueError(f"dtype {dtype} is wider than a 4-byte arena word")
    lead = raw.shape[:-1]
    out = lax.bitcast_convert_type(raw, dtype)  # [..., w] or [..., w, 4 // itemsize]
    n = math.prod(shape)
    if math.prod(out.shape[len(lead) :]) != n:  # the last word's padding
        out = out.reshape(*lead, -1)[..., :n]
    return out.reshape(*lead, *shape)


def field_to_words(value: jax.Array, rows: int | None = None) -> jax.Array:
    """Inverse of :func:`words_to_field`: the bits of ``value`` as ``uint32`` words, the last
    one zero-padded; ``[w]``, or with ``rows`` (``value``'s leading axes, flattened) one row of
    words per index, ``[rows, w]``."""
    lead = () if rows is None else (rows,)
    ratio = WORD_BYTES // value.dtype.itemsize
    flat = value.reshape(*lead, -1)
    pad = -flat.shape[-1] % ratio
    if pad:
        flat = jnp.pad(flat, [(0, 0)] * len(lead) + [(0, pad)])
    if ratio > 1:
        flat = flat.reshape(*lead, -1, ratio)
    return lax.bitcast_convert_type(flat, jnp.uint32)


def gather_windows(buffer: jax.Array, seg: jax.Array, word: jax.Array, words: int) -> jax.Array:
    """``buffer[seg[i], word[i] : word[i] + words]`` for every index ``i`` (any batch shape):
    ``uint32 [..., words]``. An out-of-range ``seg`` (e.g. ``num_segments``) reads zeros.

    The batched :func:`view`: one gather for many handles' windows."""
    idx = jnp.stack([seg, word], axis=-1).astype(jnp.int32)
    dnums = lax.GatherDimensionNumbers(
        offset_dims=(idx.ndim - 1,), collapsed_slice_dims=(0,), start_index_map=(0, 1)
    )
    return lax.gather(buffer, idx, dnums, slice_sizes=(1, words), mode=_MODE, fill_value=0)


def scatter_windows(
    buffer: jax.Array, seg: jax.Array, word: jax.Array, rows: jax.Array
) -> jax.Array:
    """``buffer[seg[i], word[i] : word[i] + w] = rows[i]`` (``rows uint32 [n, w]``, ``seg,
    word [n]``); out-of-range windows are dropped. In place when ``buffer`` is donated."""
    idx = jnp.stack([seg, word], axis=-1).astype(jnp.int32)
    dnums = lax.ScatterDimensionNumbers(
        update_window_dims=(1,), inserted_window_dims=(0,), scatter_dims_to_operand_dims=(0, 1)
    )
    return lax.scatter(buffer, idx, rows, dnums, mode=_MODE)


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "words"))
def _read_field(buf, seg, word, *, shape, dtype, words):
    raw = lax.dynamic_slice(buf, (seg, word), (1, words))[0]
    return words_to_field(raw, shape, dtype)


@functools.partial(jax.jit, donate_argnums=0)
def _write_words(buf, seg, word, value):
    return lax.dynamic_update_slice(buf, field_to_words(value)[None], (seg, word))


def free_bytes(device: jax.Device) -> int | None:
    """Bytes ``device``'s allocator has left (its limit less what live buffers hold), or
    ``None`` where the backend does not say (CPU)."""
    stats = device.memory_stats()
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))


def allocate(make, nbytes: int, devices) -> jax.Array:
    """``make()`` (an arena buffer of ``nbytes`` bytes a device), checked: a ``ValueError``
    naming ``memory_budget`` when a device reports fewer free bytes, or when the allocation
    itself fails (the allocator's free memory may be fragmented), instead of a failure at
    the first step that reads the buffer."""
    for device in devices:
        free = free_bytes(device)
        if free is not None and nbytes > free:
            raise ValueError(
                f"memory_budget: an arena of {nbytes} bytes does not fit the {free} bytes "
                f"free on {device}; give a smaller memory_budget"
            )
    try:
        return make().block_until_ready()
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise ValueError(
            f"memory_budget: the device could not allocate an arena of {nbytes} bytes (its "
            f"free memory may be fragmented); give a smaller memory_budget ({e})"
        ) from None


def check_arena_size(num_segments: int, segment_words: int) -> None:
    """ValueError for an arena of no segment or of empty segments."""
    if num_segments < 1 or segment_words < 1:
        raise ValueError(
            f"arena needs >= 1 segment of >= 1 word, got {num_segments} x {segment_words}"
        )


def move_table(moves: list[tuple[int, int, int, int]]) -> tuple[np.ndarray, np.int32]:
    """``(table int32 [size, 4], count)`` for :func:`move_units`: the ``moves`` padded with
    zero rows to a power of two, so a handful of compiled programs serve every batch size."""
    size = 1 << (len(moves) - 1).bit_length()
    table = np.zeros((size, 4), np.int32)
    table[: len(moves)] = moves
    return table, np.int32(len(moves))


@functools.partial(jax.jit, donate_argnums=0, static_argnames=("words",))
def move_units(buf, moves, count, *, words):
    """Copy ``count`` units of ``words`` words of the arena buffer ``buf [segments, words]``
    (donated: in place): ``moves[i] = (src_seg, src_w, dst_seg, dst_w)`` (:func:`move_table`).

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
    """One device buffer of ``num_segments * segment_words`` words, updated in place.

    :meth:`read`, :meth:`write`, :meth:`read_words` and :meth:`move` run through three jitted
    functions on the buffer (:meth:`_read_at`, :meth:`_write_at`, :meth:`_move_batch`), which
    an arena of another buffer layout overrides."""

    def __init__(self, num_segments: int, segment_words: int, device: jax.Device | None = None):
        check_arena_size(num_segments, segment_words)
        self.num_segments = num_segments
        self.segment_words = segment_words
        shape = (num_segments, segment_words)
        self.buffer = allocate(
            lambda: jnp.zeros(shape, jnp.uint32, device=device),
            num_segments * segment_words * WORD_BYTES,
            [device or jax.devices()[0]],
        )

    @property
    def nbytes(self) -> int:
        return self.num_segments * self.segment_words * WORD_BYTES

    def _read_at(self, seg, word, *, shape, dtype, words) -> jax.Array:
        """``words`` words at ``(seg, word)`` as a ``shape`` array of ``dtype``."""
        return _read_field(self.buffer, seg, word, shape=shape, dtype=dtype, words=words)

    def _write_at(self, seg, word, value) -> None:
        """Writes ``value``'s words at ``(seg, word)``."""
        self.buffer = _write_words(self.buffer, seg, word, value)

    def _move_batch(self, table, count, words: int) -> None:
        """Copies units as :func:`move_units` with a :func:`move_table`."""
        self.buffer = move_units(self.buffer, table, count, words=words)

    def read(self, seg: int, word: int, field: Field) -> jax.Array:
        return self._read_at(
            np.int32(seg),
            np.int32(word + field.word_offset),
            shape=field.shape,
            dtype=field.dtype,
            words=field.words,
        )

    def write(self, seg: int, word: int, field: Field, value: jax.Array) -> None:
        self._write_at(np.int32(seg), np.int32(word + field.word_offset), value)

    def read_words(self, seg: int, word: int, words: int) -> jax.Array:
        return self._read_at(
            np.int32(seg), np.int32(word), shape=(words,), dtype=np.dtype(np.uint32), words=words
        )

    def move(self, moves: list[tuple[int, int, int, int]], words: int) -> None:
        """Copy units of ``words`` words on device, one jitted call for the whole batch."""
        if moves:
            self._move_batch(*move_table(moves), words)
