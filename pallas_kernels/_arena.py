"""Addressing GDN recurrent states inside the serving memory arena, shared by the kernels that
read (and write) them in place: ``verify/arena.py``, ``commit/arena.py``, ``decode/arena.py``.

The arena is the memory manager's one ``uint32 [segments, segment_words]`` buffer. A request's
state unit sits at ``table[handle] = (segment, word)``, and one layer's f32 recurrent state
``[Hv, K, V]`` starts ``state_offset`` words further. A program ``(b, h, j)`` translates its
batch row's handle through the table, loads its ``[K, block_v]`` tile of words with one indexed
load and bitcasts it to f32; kernels that write store the tile back the same way into the
aliased (donated) arena. A handle ``< 0`` (a padding row) reads a zero state and is never
written.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._wy import F32


class Value:
    """Stands in for a ref whose whole block is a value already in registers (``ref[...]``)."""

    def __init__(self, value=None):
        self.value = value

    def __getitem__(self, idx):
        assert idx is Ellipsis
        return self.value

    def __setitem__(self, idx, value):
        assert idx is Ellipsis
        self.value = value


def tile_address(handles_ref, table_ref, *, offset: int, dk: int, dv: int, bv: int):
    """``(valid, segment, word index [dk, bv])`` of this program's state tile."""
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    handle = handles_ref[b]
    valid = handle >= 0
    handle = jnp.maximum(handle, 0)
    seg, word = table_ref[handle, 0], table_ref[handle, 1]
    base = word + offset + h * (dk * dv) + j * bv
    row = jax.lax.broadcasted_iota(jnp.int32, (dk, bv), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (dk, bv), 1)
    return valid, seg, base + row * dv + col


def load_state(arena_ref, addr):
    valid, seg, idx = addr
    s0 = jax.lax.bitcast_convert_type(arena_ref[seg, idx], F32)
    return jnp.where(valid, s0, 0.0)


def store_state(out_ref, addr, s):
    """Stores the f32 tile ``s`` as words at ``addr`` (from :func:`tile_address`) of the
    aliased arena output, masked off for a padding row."""
    valid, seg, idx = addr
    words = jax.lax.bitcast_convert_type(s, jnp.uint32)
    plt.store(out_ref.at[seg, idx], words, mask=jnp.broadcast_to(valid, idx.shape))


def check_table_handles(table, handles, b: int) -> None:
    """ValueErrors for a handle table that is not ``int [handles, 2]`` or handles that are not
    ``int [B]`` (shared by the GPU and TPU arena kernels)."""
    if table.ndim != 2 or table.shape[1] != 2 or not jnp.issubdtype(table.dtype, jnp.integer):
        raise ValueError(f"table: expected int [handles, 2], got {table.dtype} {table.shape}")
    if handles.shape != (b,) or not jnp.issubdtype(handles.dtype, jnp.integer):
        raise ValueError(f"handles: expected int [B] = ({b},), got {handles.dtype} {handles.shape}")


def check_state_fits(offset: int, hv: int, dk: int, dv: int, words: int) -> None:
    """ValueError unless one layer's ``[Hv, K, V]`` f32 state from word ``offset`` fits a
    segment of ``words`` words."""
    if not 0 <= offset or offset + hv * dk * dv > words:
        raise ValueError(
            f"state_offset: {offset} + Hv*K*V = {hv * dk * dv} words must fit a segment of "
            f"{words} words"
        )


def check_arena(arena, table, handles, b, offset, hv, dk, dv):
    if arena.ndim != 2 or arena.dtype != jnp.uint32:
        raise ValueError(
            f"arena: expected uint32 [segments, words], got {arena.dtype} {arena.shape}"
        )
    check_table_handles(table, handles, b)
    check_state_fits(offset, hv, dk, dv, arena.shape[1])


def whole():
    return pl.BlockSpec(memory_space=None)
