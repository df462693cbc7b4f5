"""GDN recurrent states read and written in place in the serving memory arena by the TPU
kernels, through the memory manager's handle table.

The arena is the memory manager's ``uint32 [segments, words]`` buffer; on a TPU the kernels
address it as lane rows, ``uint32 [segments, words / 128, 128]`` (:func:`lane_rows`): HBM
arrays are tiled, so a state must be a whole number of 128-word rows for one DMA to move it.
That asks for ``V == 128`` (a state row is a lane row) and for every state to start on a row:
``state_offset`` a multiple of 128 and the table's words multiples of 128 (units placed at
multiples of 512 bytes; not checked for traced tables).

Row ``b``'s state unit sits at ``table[handles[b]] = (segment, word)``; the handles and the
table are scalar-prefetched into SMEM (``PrefetchScalarGridSpec``). A program translates its
row's handle and moves the ``[s K, 128]`` rows of its ``s`` value heads with one DMA between the
arena (left in HBM, ``memory_space=ANY``) and a VMEM scratch, bitcasting words to f32. A handle
``< 0`` (a padding row) reads a zero state and is never written.

Reshaping a ``[segments, words]`` arena to lane rows is free where arrays are linear (CPU, GPU)
and a relayout copy on a TPU: a TPU memory manager should allocate its arena as lane rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._arena import check_state_fits, check_table_handles
from pallas_kernels.tpu._common import F32, LANES


def lane_rows(arena: jax.Array) -> jax.Array:
    """``uint32 [segments, words]`` -> ``[segments, words / 128, 128]`` (3-D: unchanged)."""
    if arena.ndim == 3:
        return arena
    return arena.reshape(arena.shape[0], arena.shape[1] // LANES, LANES)


def check_arena(arena, table, handles, b: int, offset: int, hv: int, dk: int, dv: int) -> None:
    """ValueErrors for an arena, table or handles the TPU arena kernels cannot take."""
    if arena.dtype != jnp.uint32 or arena.ndim not in (2, 3):
        raise ValueError(
            f"arena: expected uint32 [segments, words] or [segments, rows, 128], got "
            f"{arena.dtype} {arena.shape}"
        )
    words = arena.shape[1] * (arena.shape[2] if arena.ndim == 3 else 1)
    if (arena.ndim == 3 and arena.shape[2] != LANES) or words % LANES:
        raise ValueError(f"arena: segments must be whole 128-word rows, got shape {arena.shape}")
    check_table_handles(table, handles, b)
    if dv != LANES:
        raise ValueError(
            f"V: the TPU arena kernels need V == {LANES} (a state row per lane row), got {dv}"
        )
    if offset < 0 or offset % LANES:
        raise ValueError(f"state_offset: a multiple of {LANES} words >= 0, got {offset}")
    check_state_fits(offset, hv, dk, dv, words)


def state_rows(handles_ref, table_ref, b, *, offset: int, first_row):
    """``(valid, segment, first lane row)`` of row ``b``'s states, ``first_row`` rows into the
    layer's state (the first stacked head's)."""
    h = handles_ref[b]
    hh = jnp.maximum(h, 0)
    row = (table_ref[hh, 1] + offset) // LANES + first_row
    return h >= 0, table_ref[hh, 0], row


def load_states(arena_ref, buf_ref, addr, shape):
    """The f32 states ``shape = (s, K, 128)`` at ``addr`` (zeros for a padding row), through the
    ``uint32 (s K, 128)`` VMEM scratch ``buf_ref``."""
    valid, seg, row = addr
    rows = buf_ref.shape[0]

    @pl.when(valid)
    def _():
        pltpu.sync_copy(arena_ref.at[seg, pl.ds(row, rows), :], buf_ref)

    @pl.when(jnp.logical_not(valid))
    def _():
        buf_ref[...] = jnp.zeros(buf_ref.shape, jnp.uint32)

    return jax.lax.bitcast_convert_type(buf_ref[...], F32).reshape(shape)


def store_states(out_ref, buf_ref, addr, states) -> None:
    """Writes the f32 ``states (s, K, 128)`` at ``addr`` of the aliased arena output (not for
    a padding row)."""
    valid, seg, row = addr
    rows = buf_ref.shape[0]
    buf_ref[...] = jax.lax.bitcast_convert_type(states.reshape(rows, LANES), jnp.uint32)

    @pl.when(valid)
    def _():
        pltpu.sync_copy(buf_ref, out_ref.at[seg, pl.ds(row, rows), :])


def any_spec():
    """The arena operand: left in HBM, moved by the kernel's own DMAs."""
    return pl.BlockSpec(memory_space=pl.ANY)
