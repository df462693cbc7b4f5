"""The gated delta rule token by token as a Mosaic TPU kernel: the decode step (one token per
row) and, with ``T > 1``, a sequential scan over a short run of tokens, in place on the states.

Per token and value head ``h`` (key head ``h // (Hv // Hk)``), as
:func:`gdn_jax.recurrent_gated_delta_rule`::

    S = exp(g) S;   u = beta (v - S^T k);   S = S + k u^T;   o = S^T q

with ``q`` scaled by ``scale`` (default ``K ** -0.5``) after the optional l2norm of q and k, all
in f32 on the VPU (the state products are a broadcast and a sublane sum, no MXU rounding).

Grid ``(B, Hv, T / block_t)``: one program per (row, value head) keeps its ``[K, V]`` f32 state
in the aliased output block across the time blocks (the last grid axis is sequential), so the
state is read once and written once. Tokens within a block are a loop over rows of the
``[block_t, K]`` blocks. The kernel reads head-major ``[B, H, T, D]`` f32 activations and
``[B, Hv, T, 2]`` rows of ``(g, beta)``; :func:`recurrent` takes the op's layout.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._wy import F32, default_scale, pad_axis, prep_rows
from pallas_kernels.tpu._arena import (
    any_spec,
    check_arena,
    lane_rows,
    load_states,
    state_rows,
    store_states,
)
from pallas_kernels.tpu._common import (
    check_dims,
    compiler_params,
    gbeta_pairs,
    head_major,
    interpret_params,
    to_col,
    vmem_bytes,
)

BLOCK_T = 64


def token_step(s, q, k, v, gbeta, *, use_l2norm, scale):
    """One token on a ``(K, V)`` f32 state: raw rows ``q, k (1, K)``, ``v (1, V)``, ``gbeta
    (1, 2)``. Returns ``(S, o (1, V))``."""
    kc = to_col(prep_rows(k, use_l2norm))  # (K, 1)
    qc = to_col(prep_rows(q, use_l2norm, scale))
    s = s * jnp.exp(gbeta[:, 0:1])
    u = gbeta[:, 1:2] * (v - jnp.sum(kc * s, axis=0, keepdims=True))
    s = s + kc * u
    return s, jnp.sum(qc * s, axis=0, keepdims=True)


def _kernel(q_ref, k_ref, v_ref, gb_ref, s0_ref, o_ref, s_ref, *, use_l2norm, scale, block_t):
    @pl.when(pl.program_id(2) == 0)
    def _():
        s_ref[...] = s0_ref[...]

    def body(t, s):
        row = pl.ds(t, 1)
        s, o = token_step(
            s,
            q_ref[row, :],
            k_ref[row, :],
            v_ref[row, :],
            gb_ref[row, :],
            use_l2norm=use_l2norm,
            scale=scale,
        )
        o_ref[row, :] = o.astype(o_ref.dtype)
        return s

    s_ref[...] = jax.lax.fori_loop(0, block_t, body, s_ref[...])


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "block_t", "interpret"))
def recurrent(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    block_t: int = BLOCK_T,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """``T`` tokens of the gated delta rule per row on a TPU. ``q, k [B, T, Hk, K]``, ``v [B, T,
    Hv, V]``, ``g, beta [B, T, Hv]``, ``initial_state`` f32 ``[B, Hv, K, V]`` (aliased to the
    returned state: donate it to update in place).

    Returns ``(o [B, T, Hv, V] in v's dtype, final state f32 [B, Hv, K, V])``. ``T`` is padded
    to a multiple of ``block_t`` with tokens that leave the state unchanged."""
    b, t, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    check_dims(q, k, v, hk=hk, hv=hv, dk=dk, dv=dv)
    if t < 1:
        raise ValueError(f"T: at least one token per row, got {t}")
    if block_t < 1:
        raise ValueError(f"block_t: at least 1, got {block_t}")
    grp = hv // hk
    o_dtype = v.dtype
    bt = min(block_t, t)
    bt = -(-bt // 8) * 8 if bt < t else t
    tp = -(-t // bt) * bt
    q, k, v = (pad_axis(head_major(x.astype(F32)), 2, tp) for x in (q, k, v))
    gb = pad_axis(head_major(gbeta_pairs(g, beta)), 2, tp)  # [B, Hv, T, 2]
    scale = default_scale(scale, dk)
    qk_spec = pl.BlockSpec((None, None, bt, dk), lambda i, h, j: (i, h // grp, j, 0))
    v_spec = pl.BlockSpec((None, None, bt, dv), lambda i, h, j: (i, h, j, 0))
    gb_spec = pl.BlockSpec((None, None, bt, 2), lambda i, h, j: (i, h, j, 0))
    s_spec = pl.BlockSpec((None, None, dk, dv), lambda i, h, j: (i, h, 0, 0))
    need = vmem_bytes(
        [((bt, dk), F32)] * 2 + [((bt, dv), F32), ((bt, 2), F32), ((dk, dv), F32)] * 2,
        temporaries=[((dk, dv), F32)] * 4 + [((dk, dk), F32)] * 2,
    )
    kernel = functools.partial(_kernel, use_l2norm=use_qk_l2norm, scale=scale, block_t=bt)
    o, s = pl.pallas_call(
        kernel,
        grid=(b, hv, tp // bt),
        in_specs=[qk_spec, qk_spec, v_spec, gb_spec, s_spec],
        out_specs=[v_spec, s_spec],
        out_shape=[
            jax.ShapeDtypeStruct((b, hv, tp, dv), o_dtype),
            jax.ShapeDtypeStruct((b, hv, dk, dv), F32),
        ],
        input_output_aliases={4: 1},
        compiler_params=compiler_params("recurrent", need, ("parallel", "parallel", "arbitrary")),
        interpret=interpret_params(interpret),
        name="gdn_recurrent_tpu",
    )(q, k, v, gb, initial_state.astype(F32))
    return head_major(o)[:, :t], s


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "interpret"))
def recurrent_step(
    q, k, v, g, beta, initial_state, *, scale=None, use_qk_l2norm=False, interpret=False
):
    """One decode token per row: ``q, k [B, Hk, K]``, ``v [B, Hv, V]``, ``g, beta [B, Hv]``,
    ``initial_state`` f32 ``[B, Hv, K, V]`` (aliased). Returns ``(o [B, Hv, V], new state)``."""
    o, s = recurrent(
        *(x[:, None] for x in (q, k, v, g, beta)),
        initial_state,
        scale=scale,
        use_qk_l2norm=use_qk_l2norm,
        interpret=interpret,
    )
    return o[:, 0], s


@functools.partial(jax.jit, static_argnames=("state_offset", "scale", "use_qk_l2norm", "interpret"))
def recurrent_step_arena(
    q,
    k,
    v,
    g,
    beta,
    arena,
    table,
    handles,
    *,
    state_offset: int,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    zero_state=None,
    interpret: bool = False,
):
    """One decode token per row on the arena's states, in place, as
    :func:`pallas_kernels.decode.arena.recurrent_step`: ``q, k [B, Hk, K]``, ``v [B, Hv, V]``,
    ``g, beta [B, Hv]``; row ``b``'s state at ``table[handles[b]]`` plus ``state_offset`` words
    (:mod:`pallas_kernels.tpu._arena`: ``V == 128``, states on 128-word rows); a handle ``< 0``
    runs from zeros and is not written; ``zero_state[b]`` starts a valid row from zeros.
    Returns ``(o [B, Hv, V] in v's dtype, arena)`` (aliased: donate it)."""
    b, hk, dk = k.shape
    hv, dv = v.shape[1], v.shape[2]
    check_dims(q, k, v, hk=hk, hv=hv, dk=dk, dv=dv)
    check_arena(arena, table, handles, b, state_offset, hv, dk, dv)
    zs = jnp.zeros((b,), jnp.int32) if zero_state is None else zero_state.astype(jnp.int32)
    grp = hv // hk
    scale = default_scale(scale, dk)
    o_dtype = v.dtype
    q, k, v = (x.astype(F32)[:, :, None, :] for x in (q, k, v))
    gb = gbeta_pairs(g, beta)[:, :, None, :]  # [B, Hv, 1, 2]

    def kernel(hd_ref, tab_ref, zs_ref, q_ref, k_ref, v_ref, gb_ref, ar_ref, o_ref, out_ref, buf):
        i, h = pl.program_id(0), pl.program_id(1)
        valid, seg, row = state_rows(hd_ref, tab_ref, i, offset=state_offset, first_row=h * dk)
        start = valid & (zs_ref[i] == 0)
        s = load_states(ar_ref, buf, (start, seg, row), (1, dk, dv))[0]
        s, o = token_step(
            s,
            q_ref[...],
            k_ref[...],
            v_ref[...],
            gb_ref[...],
            use_l2norm=use_qk_l2norm,
            scale=scale,
        )
        o_ref[...] = o.astype(o_ref.dtype)
        store_states(out_ref, buf, (valid, seg, row), s)

    def spec(d, head):
        return pl.BlockSpec((None, None, 1, d), lambda i, h, *_: (i, head(h), 0, 0))

    key, val = (lambda h: h // grp), (lambda h: h)
    rows = lane_rows(arena)
    need = vmem_bytes(
        [((1, dk), F32)] * 2 + [((1, dv), F32), ((1, 2), F32), ((1, dv), o_dtype)],
        scratch=[((dk, dv), jnp.uint32)],
        temporaries=[((dk, dv), F32)] * 4 + [((dk, dk), F32)] * 2,
    )
    o, out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(b, hv),
            in_specs=[spec(dk, key), spec(dk, key), spec(dv, val), spec(2, val), any_spec()],
            out_specs=[spec(dv, val), any_spec()],
            scratch_shapes=[pltpu.VMEM((dk, dv), jnp.uint32)],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((b, hv, 1, dv), o_dtype),
            jax.ShapeDtypeStruct(rows.shape, rows.dtype),
        ],
        input_output_aliases={7: 1},
        compiler_params=compiler_params("recurrent_step_arena", need, ("parallel", "parallel")),
        interpret=interpret_params(interpret),
        name="gdn_recurrent_step_arena_tpu",
    )(handles.astype(jnp.int32), table.astype(jnp.int32), zs, q, k, v, gb, rows)
    return o[:, :, 0], out.reshape(arena.shape)
