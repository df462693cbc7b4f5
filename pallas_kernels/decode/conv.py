"""One decode token of a Gated DeltaNet layer's depthwise causal conv (SiLU) on the conv state
held in the serving memory arena, updated in place.

Row ``b``'s conv state ``[W-1, C]`` (the last ``W-1`` pre-conv inputs, bfloat16 or float32)
starts at word ``table[handles[b], 1] + conv_offset`` of segment ``table[handles[b], 0]``
(:mod:`pallas_kernels._arena`), row-major, bfloat16 values two to a word (the even channel in
the low half). Program ``(b, j)`` owns channels ``[j * block_c, (j + 1) * block_c)``: it reads
their ``W-1`` state rows with indexed loads, forms::

    y[c] = silu( sum_{t < W-1} weight[c, t] state[t, c] + weight[c, W-1] x[c] )

in f32 (stored in ``x``'s dtype, as :func:`gdn_jax.causal_conv1d`) and writes the shifted
window ``state[1:], x`` back over the same words of the aliased arena. No two programs touch the
same words, so the in-place update is race free. It replaces the XLA window read, the conv, the
new window and its scatter into the arena: one kernel where XLA runs four or more.

Rows: a handle ``< 0`` (padding) reads a zero state and is never written; ``zero_state[b]`` (a
fresh request) reads a zero state and is written; ``live[b] == False`` (a row whose token is
padding) leaves its state unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._arena import check_table_handles, whole
from pallas_kernels._wy import F32
from pallas_kernels.decode.arena import row_flags, silu

HIGH_HALF = 0xFFFF0000


def conv_step(
    x,
    weight,
    arena,
    table,
    handles,
    *,
    conv_offset: int,
    state_dtype,
    zero_state=None,
    live=None,
    x_col: int = 0,
    block_c: int = 256,
    num_warps: int = 4,
    interpret: bool = False,
):
    """``(y [B, C] in x's dtype, arena)``: the conv of one token per row (module docstring).

    Args:
      x: ``[B, C]`` pre-conv inputs (the state's dtype), or a wider ``[B, >= x_col + C]``
        array whose columns ``[x_col, x_col + C)`` they are (a fused input projection's output:
        no copy of the slice). weight: ``[C, W]``, which sets ``C``.
      arena: ``uint32 [segments, words]`` (aliased to the second output: donate it).
      table, handles: the handle table ``int [handles, 2]`` and ``int [B]`` handles.
      conv_offset: words from a unit's start to this layer's conv state.
      state_dtype: the stored state's dtype: ``bfloat16`` or ``float32``.
      zero_state, live: optional ``bool [B]`` (module docstring).
      x_col: the column of ``x`` where the ``C`` channels start.
      block_c: channels per program (a power of two dividing ``C``; two or more in bfloat16).
    """
    state_dtype = jnp.dtype(state_dtype)
    if state_dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"state_dtype: bfloat16 or float32, got {state_dtype}")
    if x.ndim != 2:
        raise ValueError(f"x: expected [B, C], got shape {x.shape}")
    if x.dtype != state_dtype:
        raise ValueError(f"x: must have the state's dtype {state_dtype}, got {x.dtype}")
    if weight.ndim != 2 or weight.shape[1] < 2:
        raise ValueError(f"weight: expected [C, W >= 2], got shape {weight.shape}")
    b, c = x.shape[0], weight.shape[0]
    if x_col < 0 or x_col + c > x.shape[1]:
        raise ValueError(
            f"x_col: the C = {c} channels from column {x_col} must fit x's {x.shape[1]} columns"
        )
    w = weight.shape[1]
    packed = state_dtype.itemsize == 2
    bc = min(block_c, c)
    if bc & (bc - 1) or c % bc or (packed and bc < 2):
        raise ValueError(f"block_c: a power of two dividing C = {c} (>= 2 in bfloat16), got {bc}")
    if arena.dtype != jnp.uint32 or arena.ndim != 2:
        raise ValueError(
            f"arena: expected uint32 [segments, words], got {arena.dtype} {arena.shape}"
        )
    check_table_handles(table, handles, b)
    row_words = c // 2 if packed else c
    if not 0 <= conv_offset or conv_offset + (w - 1) * row_words > arena.shape[1]:
        raise ValueError(
            f"conv_offset: {conv_offset} + (W-1) * {row_words} words must fit a segment of "
            f"{arena.shape[1]} words"
        )
    zero_state = row_flags("zero_state", zero_state, b)
    live = row_flags("live", live, b, default=1)
    lanes = bc // 2 if packed else bc  # words per state row and program

    def kernel(x_ref, w_ref, lv_ref, zs_ref, hd_ref, tab_ref, ar_ref, y_ref, out_ref):
        i, j = pl.program_id(0), pl.program_id(1)
        handle = hd_ref[i]
        valid = handle >= 0
        hnd = jnp.maximum(handle, 0)
        seg, base = tab_ref[hnd, 0], tab_ref[hnd, 1] + conv_offset
        read = valid & (zs_ref[i] == 0)
        write = jnp.broadcast_to(valid & (lv_ref[i] != 0), (lanes,))
        lane = jax.lax.broadcasted_iota(jnp.int32, (lanes,), 0)
        idx = [base + t * row_words + j * lanes + lane for t in range(w - 1)]
        words = [jnp.where(read, ar_ref[seg, ix], jnp.uint32(0)) for ix in idx]
        # each program's channels as one or two (even, odd) lane vectors
        if packed:
            chans = (j * bc + 2 * lane, j * bc + 2 * lane + 1)
            states = (
                [jax.lax.bitcast_convert_type(wd << jnp.uint32(16), F32) for wd in words],
                [jax.lax.bitcast_convert_type(wd & jnp.uint32(HIGH_HALF), F32) for wd in words],
            )
        else:
            chans = (j * bc + lane,)
            states = ([jax.lax.bitcast_convert_type(wd, F32) for wd in words],)
        xs = []
        for ch, st in zip(chans, states, strict=True):
            xc = x_ref[i, x_col + ch].astype(F32)
            acc = xc * w_ref[ch * w + (w - 1)].astype(F32)
            for t in range(w - 1):
                acc = acc + st[t] * w_ref[ch * w + t].astype(F32)
            plt.store(y_ref.at[i, ch], silu(acc).astype(y_ref.dtype))
            xs.append(xc)
        # the shifted window: rows 1.. of the old state, then x
        if packed:
            bits = [jax.lax.bitcast_convert_type(v, jnp.uint32) for v in xs]
            newest = (bits[0] >> jnp.uint32(16)) | (bits[1] & jnp.uint32(HIGH_HALF))
        else:
            newest = jax.lax.bitcast_convert_type(xs[0], jnp.uint32)
        rows = words[1:] + [newest]
        for ix, row in zip(idx, rows, strict=True):
            plt.store(out_ref.at[seg, ix], row, mask=write)

    y, arena = pl.pallas_call(
        kernel,
        grid=(b, c // bc),
        in_specs=[whole()] * 7,
        out_specs=(whole(), whole()),
        out_shape=(
            jax.ShapeDtypeStruct((b, c), x.dtype),
            jax.ShapeDtypeStruct(arena.shape, arena.dtype),
        ),
        input_output_aliases={6: 1},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="gdn_conv_step_arena",
    )(
        x,
        weight.reshape(-1),
        live,
        zero_state,
        handles.astype(jnp.int32),
        table.astype(jnp.int32),
        arena,
    )
    return y, arena
