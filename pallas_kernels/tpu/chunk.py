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

:func:`chunk_prefill_arena` is the serving engine's prefill of ``T`` tokens per row on the
recurrent states in the memory arena: the same chunk solve (:func:`chunk_update`), the
group's states DMA'd from the arena at a row's first chunk, carried in VMEM and DMA'd back in
place after its last (:mod:`pallas_kernels.tpu._arena`), ragged ``num_tokens`` per row.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._wy import F32, check_blocks, default_scale, pad_axis
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
    dot,
    gbeta_pairs,
    head_major,
    interpret_params,
    iota,
    newton_steps,
    row_scales,
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


def chunk_update(s_ref, q, k, v, g, beta, *, chunk, scale, use_l2norm, blocks):
    """One chunk of the ``s`` stacked value heads of one key head on the states in ``s_ref``
    (f32 ``(s, K, V)``, updated in place): raw ``q, k (C, K)``, ``v (s, C, V)``, ``g`` a row
    ``(1, s C)`` and ``beta`` a column ``(s C, 1)`` (heads stacked). Returns ``o (s, C, V)``
    f32."""
    s, _, dv = v.shape
    m = s * chunk
    row, col = iota((m, m), 0), iota((m, m), 1)
    incl = ((row // chunk) == (col // chunk)) & (row >= col)
    s0 = s_ref[...]
    o, u, g, rk = wy_math(
        q[None],
        k[None],
        v[None],
        g,
        beta,
        incl,
        s0[None],
        newton_steps(chunk),
        npad=chunk,
        scale=scale,
        use_l2norm=use_l2norm,
        blocks=blocks,
    )
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
    return o.reshape(s, chunk, dv)


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

    @pl.when((flags & FIRST) != 0)
    def _():
        s_ref[...] = h0_ref[...]

    @pl.when((flags & VALID) != 0)
    def _():
        o = chunk_update(
            s_ref,
            q_ref[...],
            k_ref[...],
            v_ref[...],
            g_ref[...],
            beta_ref[...],
            chunk=chunk,
            scale=scale,
            use_l2norm=use_l2norm,
            blocks=blocks,
        )
        o_ref[...] = o.astype(o_ref.dtype)

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


def _readout(o_ref, s_ref, q, *, scale, use_l2norm, precision) -> None:
    """``o = S^T q`` of the unchanged states ``s_ref (s, K, V)`` for the raw queries ``q (C,
    K)`` of a chunk with no live token, into ``o_ref (s, C, V)``: one dot over the ``s`` states
    side by side on the lanes."""
    s, _, dv = s_ref.shape
    states = jnp.concatenate([s_ref[i] for i in range(s)], axis=1) if s > 1 else s_ref[0]
    p = dot(q, states, precision) * row_scales(q, use_l2norm, scale)  # (C, s V)
    for i in range(s):
        o_ref[i] = p[:, i * dv : (i + 1) * dv].astype(o_ref.dtype)


def prefill_arena_vmem(
    c: int, s: int, dk: int, dv: int, in_dtype, o_dtype=None, g_dtype=F32
) -> int:
    """VMEM budget of one :func:`chunk_prefill_arena` program: its blocks double-buffered
    (q, k, v, the chunk's g row and beta column, o), the carried f32 states and the uint32
    DMA buffer once, and the chunk solve's temporaries (as :func:`chunk_gated_delta_rule`)."""
    m = s * c
    o_dtype = in_dtype if o_dtype is None else o_dtype
    return vmem_bytes(
        [((c, dk), in_dtype)] * 2
        + [((s, c, dv), in_dtype), ((1, m), g_dtype), ((m, 1), g_dtype), ((s, c, dv), o_dtype)],
        scratch=[((s, dk, dv), F32), ((s * dk, dv), jnp.uint32)],
        temporaries=[((m, m), F32)] * 14 + [((m, dv), F32)] * 12 + [((2 * m, dk), F32)] * 2,
    )


@functools.partial(
    jax.jit,
    static_argnames=("state_offset", "scale", "use_qk_l2norm", "chunk_size", "blocks", "interpret"),
)
def chunk_prefill_arena(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    arena: jax.Array,
    table: jax.Array,
    handles: jax.Array,
    *,
    state_offset: int,
    num_tokens: jax.Array | None = None,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    zero_state: jax.Array | None = None,
    chunk_size: int = 64,
    blocks: TpuChunkBlocks = DEFAULT_TPU_CHUNK_BLOCKS,
    interpret: bool = False,
):
    """``T`` tokens of the gated delta rule per batch row on the arena's recurrent states, in
    place, in chunked (WY) form on a TPU; the contract of
    :func:`pallas_kernels.decode.arena.recurrent_prefill`.

    Args:
      q, k: ``[B, T, Hk, K]``; v: ``[B, T, Hv, V]`` (f32 or bf16; ``V == 128``).
      g, beta: ``[B, T, Hv]`` log decay and write strength.
      arena: ``uint32 [segments, words]`` or lane rows ``[segments, words / 128, 128]``
        (aliased to the second output: donate it).
      table: ``int [handles, 2]`` handle -> ``(segment, word)``; handles: ``int [B]``, ``< 0``
        a padding row (runs from a zero state, never written). Row ``b``'s f32 state ``[Hv, K,
        V]`` sits ``state_offset`` words after ``table[handles[b], 1]`` of segment
        ``table[handles[b], 0]`` (:mod:`pallas_kernels.tpu._arena`: on 128-word lane rows).
      num_tokens: optional ``int [B]``: the first ``num_tokens[b]`` tokens of row ``b`` update
        the state (default ``T``); later tokens leave it unchanged (``g = beta = 0``) and their
        output is ``S^T q`` of the unchanged state.
      zero_state: optional ``bool [B]``: valid rows that start from a zero state (a fresh
        request, whose unit holds stale bits) and are still written, also with no live token.
      chunk_size: tokens per chunk, one of ``16, 32, 64, 128``; a shorter ``T`` takes the
        smallest of those that holds it.

    Returns ``(o [B, T, Hv, V] in v's dtype, arena)``.

    Grid ``(row, group of s value heads of one key head, chunk)``, the chunk axis sequential:
    the first chunk DMAs the group's ``s`` states ``[s K, 128]`` from the arena into a VMEM
    scratch (zeros for a padding or ``zero_state`` row), every chunk advances them by the
    in-chunk WY solve of :func:`chunk_gated_delta_rule` (:func:`chunk_update`), and the last
    chunk DMAs them back into the aliased arena (not for a padding row). A chunk past the row's
    live tokens only reads the states out (``o = S^T q``, one dot). Each token is read once and
    each state moved once each way; no state or ``U`` goes through HBM between chunks.

    VMEM per program (:func:`prefill_arena_vmem`): the chunk's blocks double-buffered, the
    states and the DMA buffer (``2 s K 128`` words) and the solve's temporaries, about 14
    ``(sC, sC)`` and 12 ``(sC, 128)`` f32 arrays: 2.5-2.7 MiB at ``K = 128``, ``C = 64`` and
    two stacked heads (``sC = 128``, the v5e MXU's rows; bf16 or f32 inputs), 6.4-6.8 MiB at
    ``C = 128`` with two, under the 16 MiB default scope; :func:`compiler_params` refuses a
    configuration above 64 MiB."""
    b, t, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    check_dims(q, k, v, hk=hk, hv=hv, dk=dk, dv=dv)
    if t < 1:
        raise ValueError(f"T: at least one token per row, got {t}")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (b, t, hv):
            raise ValueError(f"{name}: expected shape [B, T, Hv] = {(b, t, hv)}, got {x.shape}")
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(
            f"chunk_size: the TPU chunk kernel takes one of {CHUNK_SIZES}, got {chunk_size}"
        )
    check_blocks(blocks, TpuChunkBlocks)
    check_arena(arena, table, handles, b, state_offset, hv, dk, dv)

    def row_ints(name, x, default):
        if x is None:
            return jnp.full((b,), default, jnp.int32)
        if x.shape != (b,):
            raise ValueError(f"{name}: expected shape [B] = ({b},), got {x.shape}")
        return x.astype(jnp.int32)

    nt = jnp.clip(row_ints("num_tokens", num_tokens, t), 0, t)
    zs = row_ints("zero_state", zero_state, 0)
    c = min(chunk_size, next((x for x in CHUNK_SIZES if x >= t), CHUNK_SIZES[-1]))
    grp = hv // hk
    s = blocks.solve.stacking(1, grp, c)[1]
    nc = -(-t // c)
    tp, m = nc * c, s * c
    o_dtype = v.dtype
    live = jnp.arange(t, dtype=jnp.int32)[None, :] < nt[:, None]  # [B, T]
    gb = jnp.where(live[:, :, None, None], gbeta_pairs(g, beta), 0.0)  # [B, T, Hv, 2]
    q, k, v, gb = (pad_axis(x, 1, tp) for x in (q, k, v, gb))
    # [B, Tp, Hv, 2] -> [B, Hv/s, NC, 2, s*C]: each chunk's g and beta of s stacked heads.
    gb = gb.reshape(b, nc, c, hv // s, s, 2).transpose(0, 3, 1, 5, 4, 2)
    gb = gb.reshape(b, hv // s, nc, 2, m)
    g_rows, beta_cols = gb[:, :, :, 0:1, :], gb[:, :, :, 1, :, None]
    q, k, v = head_major(q), head_major(k), head_major(v)
    scale = default_scale(scale, dk)
    solve = blocks.solve

    def kernel(nt_ref, hd_ref, tab_ref, zs_ref, *refs):
        q_ref, k_ref, v_ref, g_ref, beta_ref, ar_ref, o_ref, out_ref, s_ref, buf = refs
        i, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        valid, seg, row = state_rows(hd_ref, tab_ref, i, offset=state_offset, first_row=h * s * dk)

        @pl.when(j == 0)
        def _():
            start = valid & (zs_ref[i] == 0)
            s_ref[...] = load_states(ar_ref, buf, (start, seg, row), (s, dk, dv))

        active = j * c < nt_ref[i]

        @pl.when(active)
        def _():
            o = chunk_update(
                s_ref,
                q_ref[...],
                k_ref[...],
                v_ref[...],
                g_ref[...],
                beta_ref[...],
                chunk=c,
                scale=scale,
                use_l2norm=use_qk_l2norm,
                blocks=solve,
            )
            o_ref[...] = o.astype(o_ref.dtype)

        @pl.when(jnp.logical_not(active))
        def _():
            _readout(
                o_ref,
                s_ref,
                q_ref[...],
                scale=scale,
                use_l2norm=use_qk_l2norm,
                precision=solve.precision,
            )

        @pl.when(j == nc - 1)
        def _():
            store_states(out_ref, buf, (valid, seg, row), s_ref[...])

    qk_spec = pl.BlockSpec((None, None, c, dk), lambda r, h, j, *_: (r, (h * s) // grp, j, 0))
    v_spec = pl.BlockSpec((None, s, c, dv), lambda r, h, j, *_: (r, h, j, 0))
    g_spec = pl.BlockSpec((None, None, None, 1, m), lambda r, h, j, *_: (r, h, j, 0, 0))
    beta_spec = pl.BlockSpec((None, None, None, m, 1), lambda r, h, j, *_: (r, h, j, 0, 0))
    rows = lane_rows(arena)
    need = prefill_arena_vmem(c, s, dk, dv, q.dtype, o_dtype)
    o, out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(b, hv // s, nc),
            in_specs=[qk_spec, qk_spec, v_spec, g_spec, beta_spec, any_spec()],
            out_specs=[v_spec, any_spec()],
            scratch_shapes=[pltpu.VMEM((s, dk, dv), F32), pltpu.VMEM((s * dk, dv), jnp.uint32)],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((b, hv, tp, dv), o_dtype),
            jax.ShapeDtypeStruct(rows.shape, rows.dtype),
        ],
        input_output_aliases={9: 1},
        compiler_params=compiler_params(
            "chunk_prefill_arena", need, ("parallel", "parallel", "arbitrary")
        ),
        interpret=interpret_params(interpret),
        name="gdn_chunk_prefill_arena_tpu",
    )(
        nt,
        handles.astype(jnp.int32),
        table.astype(jnp.int32),
        zs,
        q,
        k,
        v,
        g_rows,
        beta_cols,
        rows,
    )
    return head_major(o)[:, :t], out.reshape(arena.shape)
