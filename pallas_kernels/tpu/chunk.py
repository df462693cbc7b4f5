"""Chunked prefill of the gated delta rule as one Mosaic TPU kernel (chunks of 64 or 128
tokens, packed sequences through ``cu_seqlens``).

A chunk is the tree WY verify of a chain whose initial state is the state after the previous
chunk (docs/design.md): with the in-chunk cumulative log decay ``Gc`` and incoming state ``S``,
per value head::

    A[i, j] = beta_i exp(Gc_i - Gc_j) k_i . k_j  (j < i);   U = (I + A)^-1 diag(beta) (V - diag(e^Gc) K S)
    O = diag(e^Gc) Q S + ((Q K^T) * D) U;                    S <- e^{Gc_last} S + K^T (e^{Gc_last - Gc} * U)

Grid ``(row, group of s value heads, chunk slot)``: the slot axis is sequential and carries the
group's ``s`` states ``[s, K, V]`` in a VMEM scratch, the other two are parallel. The in-chunk
solve is :func:`pallas_kernels.tpu.verify.wy_math` on the chain mask, with the ``s`` heads of
one key head stacked block-diagonally (``s * C`` rows). Unlike the GPU's three kernels, no
per-chunk state or ``U`` goes through HBM: each token is read once and each output written once.

Packed sequences: an XLA prologue lays the tokens out in chunk slots (a sequence starts a new
slot; a short last chunk is padded with tokens ``k = v = g = beta = 0``, which change nothing)
and scalar-prefetches each slot's sequence id and flags (valid, first, last). The first slot of a
sequence loads its initial state, the last one writes its final state (a sequence of no tokens
keeps its initial state). Outputs are gathered back to the token order by XLA.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._wy import F32, check_blocks, default_scale
from pallas_kernels.tpu._common import (
    check_dims,
    compiler_params,
    dot,
    gbeta_pairs,
    head_major,
    interpret_params,
    iota,
    newton_steps,
    to_row,
    vmem_bytes,
)
from pallas_kernels.tpu.verify import TpuVerifyBlocks, wy_math

CHUNK_SIZES = (16, 32, 64, 128)
VALID, FIRST, LAST = 1, 2, 4


@dataclasses.dataclass(frozen=True)
class TpuChunkBlocks:
    """Static knobs of the TPU chunked prefill: ``solve``, the in-chunk solve and dot knobs
    (a :class:`TpuVerifyBlocks`; its ``mxu_rows`` / ``heads`` pick the stacked heads)."""

    solve: TpuVerifyBlocks = TpuVerifyBlocks()

    def __post_init__(self):
        if not isinstance(self.solve, TpuVerifyBlocks):
            raise ValueError(f"blocks.solve: a TpuVerifyBlocks, got {type(self.solve).__name__}")


DEFAULT_TPU_CHUNK_BLOCKS = TpuChunkBlocks()


def _kernel(
    seq_ref,
    flag_ref,
    q_ref,
    k_ref,
    v_ref,
    g_ref,
    beta_ref,
    h0_ref,
    o_ref,
    fin_ref,
    s_ref,
    *,
    chunk,
    scale,
    use_l2norm,
    blocks,
):
    r, c = pl.program_id(0), pl.program_id(2)
    flags = flag_ref[r, c]
    s, _, dv = o_ref.shape
    m = s * chunk

    @pl.when((flags & FIRST) != 0)
    def _():
        s_ref[...] = h0_ref[...]

    @pl.when((flags & VALID) != 0)
    def _():
        row, col = iota((m, m), 0), iota((m, m), 1)
        incl = ((row // chunk) == (col // chunk)) & (row >= col)
        s0 = s_ref[...]
        k = k_ref[...]
        o, u, g, rk = wy_math(
            q_ref[...][None],
            k[None],
            v_ref[...][None],
            g_ref[...],
            beta_ref[...],
            incl,
            s0[None],
            newton_steps(chunk),
            npad=chunk,
            scale=scale,
            use_l2norm=use_l2norm,
            blocks=blocks,
        )
        o_ref[...] = o.reshape(s, chunk, dv).astype(o_ref.dtype)
        # G of each head's last token, as a column over the head's rows: the diagonal of
        # ``where(same head & last row, G_row, 0)`` summed over lanes.
        g_row = to_row(g)
        last = (col // chunk == row // chunk) & (col % chunk == chunk - 1)
        g_last = jnp.sum(jnp.where(last, g_row, 0.0), axis=1, keepdims=True)  # (m, 1)
        w = jnp.exp(g_last - g) * rk * u  # (m, V)
        for i in range(s):
            rows = slice(i * chunk, (i + 1) * chunk)
            upd = dot(k, w[rows], blocks.precision, trans_a=True)
            s_ref[i] = jnp.exp(g_last[i * chunk : i * chunk + 1]) * s0[i] + upd

    @pl.when((flags & LAST) != 0)
    def _():
        fin_ref[...] = s_ref[...]


def chunk_plan(cu_seqlens, t: int, c: int):
    """XLA: the slot layout of packed sequences. Returns ``(src [NS * C] token index or -1,
    seq [NS], flags [NS], slot of each token [T], position in its slot [T])`` with ``NS = T // C
    + S`` slots (enough for any lengths)."""
    cu = cu_seqlens.astype(jnp.int32)
    n_seq = cu.shape[0] - 1
    ns = t // c + n_seq
    lens = cu[1:] - cu[:-1]
    nch = (lens + c - 1) // c
    cs = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(nch)])
    slot = jnp.arange(ns, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cs[1:], slot, side="right").astype(jnp.int32), 0, n_seq - 1)
    j = slot - cs[seq]
    valid = slot < cs[-1]
    start = cu[seq] + j * c
    length = jnp.where(valid, jnp.minimum(c, cu[seq + 1] - start), 0)
    pos = jnp.arange(c, dtype=jnp.int32)
    src = jnp.where(pos[None, :] < length[:, None], start[:, None] + pos[None, :], -1)
    flags = (
        valid.astype(jnp.int32) * VALID
        + (valid & (j == 0)).astype(jnp.int32) * FIRST
        + (valid & (j == nch[seq] - 1)).astype(jnp.int32) * LAST
    )
    tok = jnp.arange(t, dtype=jnp.int32)
    tseq = jnp.clip(jnp.searchsorted(cu[1:], tok, side="right").astype(jnp.int32), 0, n_seq - 1)
    off = tok - cu[tseq]
    return src.reshape(-1), seq, flags, cs[tseq] + off // c, off % c


def _to_slots(x, src):
    """Rows of ``x [1, T, ...]`` gathered into the slot layout ``[1, NS * C, ...]`` (zeros where
    ``src < 0``)."""
    y = jnp.take(x[0], jnp.maximum(src, 0), axis=0)
    mask = (src >= 0).reshape((-1,) + (1,) * (y.ndim - 1))
    return jnp.where(mask, y, jnp.zeros((), y.dtype))[None]


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "use_qk_l2norm",
        "output_final_state",
        "chunk_size",
        "blocks",
        "interpret",
    ),
)
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
    output_final_state: bool = True,
    chunk_size: int = 64,
    cu_seqlens: jax.Array | None = None,
    blocks: TpuChunkBlocks = DEFAULT_TPU_CHUNK_BLOCKS,
    interpret: bool = False,
):
    """The gated delta rule over whole sequences on a TPU, as
    :func:`pallas_kernels.chunk_gated_delta_rule`: ``q, k [B, T, Hk, K]``, ``v [B, T, Hv, V]``,
    ``g, beta [B, T, Hv]``, ``initial_state [B or S, Hv, K, V]`` (optional); with
    ``cu_seqlens [S + 1]`` (``B == 1``) the ``T`` axis packs ``S`` sequences. Returns ``(o
    [B, T, Hv, V] in v's dtype, final state f32 [B or S, Hv, K, V] or None)``."""
    b, t, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    check_dims(q, k, v, hk=hk, hv=hv, dk=dk, dv=dv)
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(
            f"chunk_size: the TPU chunk kernel takes one of {CHUNK_SIZES}, got {chunk_size}"
        )
    check_blocks(blocks, TpuChunkBlocks)
    c = chunk_size
    grp = hv // hk
    s = blocks.solve.stacking(1, grp, c)[1]
    o_dtype = v.dtype
    gb = gbeta_pairs(g, beta)  # [B, T, Hv, 2]
    if cu_seqlens is None:
        rows, n_seq, ns = b, b, -(-t // c)
        tp = ns * c
        q, k, v, gb = (
            jnp.pad(x, [(0, 0), (0, tp - t)] + [(0, 0)] * (x.ndim - 2)) for x in (q, k, v, gb)
        )
        slot = jnp.arange(ns, dtype=jnp.int32)
        one = (
            VALID
            + (slot == 0).astype(jnp.int32) * FIRST
            + (slot == ns - 1).astype(jnp.int32) * LAST
        )
        flags = jnp.broadcast_to(one, (b, ns))
        seq = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, ns))
    else:
        if b != 1:
            raise ValueError(f"cu_seqlens: packed sequences need B == 1, got B={b}")
        rows, n_seq = 1, cu_seqlens.shape[0] - 1
        src, seq1, flags1, tok_slot, tok_pos = chunk_plan(cu_seqlens, t, c)
        ns = seq1.shape[0]
        q, k, v, gb = (_to_slots(x, src) for x in (q, k, v, gb))
        seq, flags = seq1[None], flags1[None]
    h0 = jnp.zeros((n_seq, hv, dk, dv), F32) if initial_state is None else initial_state.astype(F32)
    # [R, NS*C, Hv, 2] -> [R, Hv/s, NS, 2, s*C]: each slot's g and beta of s stacked heads.
    gb = gb.reshape(rows, ns, c, hv // s, s, 2).transpose(0, 3, 1, 5, 4, 2)
    gb = gb.reshape(rows, hv // s, ns, 2, s * c)
    g_rows, beta_cols = gb[:, :, :, 0:1, :], gb[:, :, :, 1, :, None]
    q, k, v = head_major(q), head_major(k), head_major(v)

    qk_spec = pl.BlockSpec((None, None, c, dk), lambda r, h, j, *_: (r, (h * s) // grp, j, 0))
    v_spec = pl.BlockSpec((None, s, c, dv), lambda r, h, j, *_: (r, h, j, 0))
    g_spec = pl.BlockSpec((None, None, None, 1, s * c), lambda r, h, j, *_: (r, h, j, 0, 0))
    beta_spec = pl.BlockSpec((None, None, None, s * c, 1), lambda r, h, j, *_: (r, h, j, 0, 0))
    st_spec = pl.BlockSpec((None, s, dk, dv), lambda r, h, j, seq_ref, _: (seq_ref[r, j], h, 0, 0))
    m = s * c
    need = vmem_bytes(
        [((c, dk), q.dtype)] * 2
        + [((s, c, dv), v.dtype), ((1, m), F32), ((m, 1), F32), ((s, dk, dv), F32)]
        + [((s, c, dv), o_dtype)]
        + [((s, dk, dv), F32)],
        scratch=[((s, dk, dv), F32)],
        temporaries=[((m, m), F32)] * 14 + [((m, dv), F32)] * 12 + [((2 * m, dk), F32)] * 2,
    )
    kernel = functools.partial(
        _kernel,
        chunk=c,
        scale=default_scale(scale, dk),
        use_l2norm=use_qk_l2norm,
        blocks=blocks.solve,
    )
    o, fin = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(rows, hv // s, ns),
            in_specs=[qk_spec, qk_spec, v_spec, g_spec, beta_spec, st_spec],
            out_specs=[v_spec, st_spec],
            scratch_shapes=[pltpu.VMEM((s, dk, dv), F32)],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((rows, hv, ns * c, dv), o_dtype),
            jax.ShapeDtypeStruct((n_seq, hv, dk, dv), F32),
        ],
        compiler_params=compiler_params(
            "chunk_gated_delta_rule", need, ("parallel", "parallel", "arbitrary")
        ),
        interpret=interpret_params(interpret),
        name="gdn_chunk_tpu",
    )(seq.astype(jnp.int32), flags.astype(jnp.int32), q, k, v, g_rows, beta_cols, h0)
    o = head_major(o)  # [R, NS*C, Hv, V]
    if cu_seqlens is None:
        o = o[:, :t]
    else:
        o = o[:, tok_slot * c + tok_pos]
        empty = (cu_seqlens[1:] == cu_seqlens[:-1])[:, None, None, None]
        fin = jnp.where(empty, h0, fin)
    return o, (fin if output_final_state else None)
