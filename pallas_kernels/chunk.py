"""The gated delta rule over whole sequences (prefill) in chunked WY form, with packed sequences.

One program per (sequence, value head, block of value columns) carries the state ``S [K, Vb]`` in
registers across chunks of ``C`` tokens. Per chunk, with in-chunk cumulative decay ``Gc``
(a chain tree: ``P`` is the lower triangle; DESIGN.md section 3)::

    (I + A) U = diag(beta) (V - diag(e^Gc) K S);   O = diag(e^Gc) Q S + ((Q K^T) * D) U
    S <- exp(Gc_last) S + K^T diag(exp(Gc_last - Gc)) U

Sequences are ``[cu[s], cu[s+1])`` of the flattened token axis; the last chunk of a sequence is
read and written under a mask (masked rows have ``k = v = beta = g = 0``: they change nothing).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._wy import (
    DEFAULT_BLOCKS,
    F32,
    DotBlocks,
    check_float,
    check_pow2_dim,
    dot,
    dot_precision,
    masked_decay,
    pad_axis,
    prep_rows,
    wy_block,
)

# On the H200 a 64-token chunk asks for 256 KiB of shared memory (the limit is 227 KiB per block).
GPU_MAX_CHUNK = 32


ChunkBlocks = DotBlocks


def _kernel(
    cu_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, s0_ref, o_ref, sf_ref,
    *, chunk, scale, use_l2norm, precision,
):  # fmt: skip
    seq = pl.program_id(0)
    start, end = cu_ref[seq], cu_ref[seq + 1]
    c = chunk
    row = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
    incl, strict = row >= col, row > col
    pos = jax.lax.broadcasted_iota(jnp.int32, (c,), 0)
    dk, bv = s0_ref.shape

    def body(i, s):
        t0 = start + i * c
        m = t0 + pos < end
        mk, mv = jnp.broadcast_to(m[:, None], (c, dk)), jnp.broadcast_to(m[:, None], (c, bv))
        q = prep_rows(plt.load(q_ref.at[pl.ds(t0, c), :], mask=mk, other=0.0), use_l2norm, scale)
        k = prep_rows(plt.load(k_ref.at[pl.ds(t0, c), :], mask=mk, other=0.0), use_l2norm)
        v = plt.load(v_ref.at[pl.ds(t0, c), :], mask=mv, other=0.0).astype(F32)
        g = plt.load(g_ref.at[pl.ds(t0, c)], mask=m, other=0.0).astype(F32)
        beta = plt.load(beta_ref.at[pl.ds(t0, c)], mask=m, other=0.0).astype(F32)
        gc = jnp.cumsum(g)
        decay = masked_decay(gc[:, None], gc[None, :], incl)
        o, u = wy_block(q, k, v, beta, gc, decay, strict, s, precision)
        plt.store(o_ref.at[pl.ds(t0, c), :], o.astype(o_ref.dtype), mask=mv)
        g_last = jnp.sum(jnp.where(pos == c - 1, gc, 0.0))
        w = jnp.exp(g_last - gc)[:, None]
        return jnp.exp(g_last) * s + dot(k, w * u, precision, trans_a=True)

    n_chunks = (end - start + c - 1) // c
    s = jax.lax.fori_loop(0, n_chunks, body, s0_ref[...].astype(F32))
    sf_ref[...] = s


def chunk_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None = None,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
    cu_seqlens: jax.Array | None = None,
    blocks: ChunkBlocks = DEFAULT_BLOCKS,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Chunked gated delta rule. ``q, k [B, T, Hk, K]``, ``v [B, T, Hv, V]``, ``g, beta
    [B, T, Hv]``; with ``cu_seqlens [S + 1]`` (``B == 1``) the ``T`` axis packs ``S`` sequences.

    Returns ``(o [B, T, Hv, V] in v's dtype, final state f32 [B or S, Hv, K, V])``.
    """
    b, t, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    check_pow2_dim("K", dk)
    check_pow2_dim("V", dv)
    check_pow2_dim("chunk_size", chunk_size, 16, 128 if interpret else GPU_MAX_CHUNK)
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_float(name, x)
    bv = min(blocks.block_v, dv)
    scale = dk**-0.5 if scale is None else float(scale)
    if cu_seqlens is None:
        cu = jnp.arange(b + 1, dtype=jnp.int32) * t
    else:
        cu = cu_seqlens.astype(jnp.int32)
    n_seq = cu.shape[0] - 1
    if initial_state is None:
        initial_state = jnp.zeros((n_seq, hv, dk, dv), F32)
    tt = b * t
    q, k, v, g, beta = (x.reshape((tt,) + x.shape[2:]) for x in (q, k, v, g, beta))
    if interpret:
        # Interpret mode clamps out-of-range slices instead of masking: give it room.
        q, k, v, g, beta = (pad_axis(x, 0, tt + chunk_size) for x in (q, k, v, g, beta))
    tp = q.shape[0]
    grp = hv // hk
    kernel = functools.partial(
        _kernel,
        chunk=chunk_size,
        scale=scale,
        use_l2norm=use_qk_l2norm,
        precision=dot_precision(blocks.precision, interpret),
    )
    s_spec = pl.BlockSpec((None, None, dk, bv), lambda s, h, j: (s, h, 0, j))
    vo_spec = pl.BlockSpec((tp, None, bv), lambda s, h, j: (0, h, j))
    o, final = pl.pallas_call(
        kernel,
        grid=(n_seq, hv, dv // bv),
        in_specs=[
            pl.BlockSpec((n_seq + 1,), lambda s, h, j: (0,)),
            pl.BlockSpec((tp, None, dk), lambda s, h, j: (0, h // grp, 0)),
            pl.BlockSpec((tp, None, dk), lambda s, h, j: (0, h // grp, 0)),
            vo_spec,
            pl.BlockSpec((tp, None), lambda s, h, j: (0, h)),
            pl.BlockSpec((tp, None), lambda s, h, j: (0, h)),
            s_spec,
        ],
        out_specs=[vo_spec, s_spec],
        out_shape=[
            jax.ShapeDtypeStruct((tp, hv, dv), v.dtype),
            jax.ShapeDtypeStruct((n_seq, hv, dk, dv), F32),
        ],
        compiler_params=plt.CompilerParams(
            num_warps=blocks.num_warps, num_stages=blocks.num_stages
        ),
        interpret=interpret,
        name="gdn_chunk",
    )(cu, q, k, v, g, beta, initial_state)
    return o[:tt].reshape(b, t, hv, dv), final
