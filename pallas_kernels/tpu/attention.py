"""Paged attention over KV pages inside the serving memory arena as a Mosaic TPU kernel, the
pages read in place through the handle table: decode and (chunked) prefill, causal in each
query's position, as :func:`pallas_kernels.attention.arena.paged_attention` on GPU.

Query ``t`` of row ``b`` (position ``q_pos[b, t]``) sees the committed keys ``j < kv_len[b]``
with ``j <= q_pos[b, t]``; the new tokens' K/V are already in the pages. Same result as the XLA
path's ``attend_committed`` over the gathered pages.

Arena addressing (:mod:`pallas_kernels.tpu._arena`: the arena as ``uint32 [segments, rows,
128]`` lane rows). A KV unit is ``[La, 2, S, Hkv, D]`` in the cache dtype, ``kv_offset`` words
into the unit (``serving.arena_spec.ArenaSpec``); row ``b``'s logical page ``j`` is the unit of
``page_handles[b, j]`` at ``table[handle] = (segment, word)``. The kernel needs a head row to be
one lane row (``D`` f32 or ``D / 2`` bf16 words = 128: head dim 128 in f32, 256 in bf16, as
Qwen3.5's full attention) and ``kv_offset`` on a row, so one page's K (or V) of one layer is
``S * Hkv`` whole rows, moved by one DMA. A bf16 word holds elements ``2i`` (low half) and
``2i + 1`` (high half): ``bitcast(w << 16)`` and ``bitcast(w & 0xffff0000)`` are the even and
odd columns, exact; the queries come split the same way and the output's even and odd columns
are interleaved after the kernel.

Grid ``(B,)``: one program per batch row stacks its ``T * Hq`` query rows (row ``t * Hq + h``)
against every KV head's keys of a page at once, ``S * Hkv`` key rows (row ``s * Hkv + k``), and
masks the pairs whose heads differ (grouped heads: query head ``h`` reads KV head
``h // (Hq / Hkv)``); the row and column positions and heads come in as small int blocks. A
``fori_loop`` over the row's ``ceil(kv_len / S)`` pages runs the online softmax in f32 (dots at
``Precision.HIGHEST``); page ``j + 1``'s K and V DMAs run while page ``j`` is computed (two
buffers each). Keys at or past ``kv_len`` (a recycled page holds arbitrary bits) read as
zeros and score nothing; an unmapped page (handle ``-1``) below ``kv_len`` reads as zeros that
score 0, as the XLA path's gather of it; a query row with no key (a padding row) returns zeros.

VMEM: the ``[P, T Hq, 128]`` f32 query and output blocks (``P`` = 1 for f32, 2 for bf16), two
double ``[S Hkv, 128]`` word buffers and the ``[T Hq, S Hkv]`` scores; stated per call in
``vmem_limit_bytes``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tpu._arena import any_spec, lane_rows
from pallas_kernels.tpu._common import F32, LANES, compiler_params, interpret_params, vmem_bytes

NEG = -1e30  # the score of a masked key (finite: exp(NEG - m) is 0, never NaN)


def _parts(dtype) -> int:
    """Values per 32-bit word of the cache: 1 (f32) or 2 (bf16)."""
    d = jnp.dtype(dtype)
    if d == jnp.float32:
        return 1
    if d == jnp.bfloat16:
        return 2
    raise ValueError(f"kv_dtype: the TPU paged attention reads float32 or bfloat16, got {d}")


def check_paged(q, arena, table, page_handles, kv_len, q_pos, *, kv_heads, kv_offset, kv_dtype):
    """ValueErrors for inputs :func:`paged_attention_arena` cannot take (before tracing)."""
    if q.ndim != 4:
        raise ValueError(f"q: expected [B, T, Hq, D], got {q.shape}")
    b, t, hq, d = q.shape
    if hq % kv_heads:
        raise ValueError(f"q: {hq} query heads are not a multiple of kv_heads {kv_heads}")
    parts = _parts(kv_dtype)
    if d != LANES * parts:
        raise ValueError(
            f"head_dim: the TPU paged attention needs a head row of {LANES} words (head dim "
            f"{LANES} in float32, {2 * LANES} in bfloat16), got {d} in {jnp.dtype(kv_dtype)}"
        )
    if kv_offset < 0 or kv_offset % LANES:
        raise ValueError(f"kv_offset: a multiple of {LANES} words >= 0, got {kv_offset}")
    if arena.dtype != jnp.uint32 or arena.ndim not in (2, 3):
        raise ValueError(f"arena: expected uint32 [segments, words], got {arena.dtype}")
    words = arena.shape[1] * (arena.shape[2] if arena.ndim == 3 else 1)
    if (arena.ndim == 3 and arena.shape[2] != LANES) or words % LANES:
        raise ValueError(f"arena: segments must be whole 128-word rows, got shape {arena.shape}")
    if table.ndim != 2 or table.shape[1] != 2:
        raise ValueError(f"table: expected int [handles, 2], got {table.shape}")
    if page_handles.ndim != 2 or page_handles.shape[0] != b:
        raise ValueError(
            f"page_handles: expected int [B, MP] with B = {b}, got {page_handles.shape}"
        )
    if kv_len.shape != (b,) or q_pos.shape != (b, t):
        raise ValueError(
            f"kv_len / q_pos: expected [B] and [B, T] = ({b},) and ({b}, {t}), got "
            f"{kv_len.shape} and {q_pos.shape}"
        )


@functools.partial(
    jax.jit,
    static_argnames=(
        "layer",
        "kv_offset",
        "page_size",
        "kv_dtype",
        "kv_heads",
        "scale",
        "interpret",
    ),
)
def paged_attention_arena(
    q,
    *,
    arena,
    table,
    page_handles,
    layer: int,
    kv_offset: int,
    page_size: int,
    kv_dtype,
    kv_len,
    q_pos,
    kv_heads: int,
    scale: float,
    interpret: bool = False,
):
    """``q [B, T, Hq, D]`` over attention layer ``layer``'s pages of each row in the arena,
    causal in ``q_pos [B, T]`` and bounded by ``kv_len [B]`` (module doc); returns
    ``[B, T, Hq, D]`` in q's dtype. ``interpret``: TPU interpret mode (any backend)."""
    check_paged(
        q, arena, table, page_handles, kv_len, q_pos,
        kv_heads=kv_heads, kv_offset=kv_offset, kv_dtype=kv_dtype,
    )  # fmt: skip
    b, t, hq, d = q.shape
    parts, s_, hkv = _parts(kv_dtype), page_size, kv_heads
    group = hq // hkv
    r, c = t * hq, s_ * hkv  # query rows, key rows of a page
    qf = q.astype(F32).reshape(b, r, d)
    qp = jnp.stack([qf[..., i::parts] for i in range(parts)])  # [P, B, R, 128]
    row_pos = jnp.repeat(q_pos.astype(jnp.int32), hq, axis=1)[..., None]  # [B, R, 1]
    row_head = jnp.tile(jnp.arange(hq, dtype=jnp.int32) // group, t)[:, None]  # [R, 1]
    col = jnp.arange(c, dtype=jnp.int32)
    col_off, col_head = (col // hkv)[None, :], (col % hkv)[None, :]  # [1, C]: page offset, head
    k_row = kv_offset // LANES + 2 * layer * c  # the layer's K rows in a unit; V follows
    rows = lane_rows(arena)

    def words_to(w):
        if parts == 1:
            return [jax.lax.bitcast_convert_type(w, F32)]
        even = jax.lax.bitcast_convert_type(jax.lax.shift_left(w, jnp.uint32(16)), F32)
        odd = jax.lax.bitcast_convert_type(w & jnp.uint32(0xFFFF0000), F32)
        return [even, odd]

    def kernel(pt_ref, tab_ref, len_ref, q_ref, rp_ref, rh_ref, co_ref, ch_ref, ar_ref, o_ref,
               kbuf, vbuf, sem):  # fmt: skip
        i = pl.program_id(0)
        lim = len_ref[i]
        rpos, rhead = rp_ref[...], rh_ref[...]  # [R, 1]
        coff, chead = co_ref[...], ch_ref[...]  # [1, C]
        key_off = jnp.transpose(coff)  # [C, 1]: each key row's offset in its page
        qs = [q_ref[p] for p in range(parts)]

        def copies(j, slot):
            """Page ``j``'s K and V DMAs into buffer ``slot`` (an unmapped page: row 0 of
            segment 0, masked out after the load)."""
            h = pt_ref[i, j]
            hh = jnp.maximum(h, 0)
            seg = jnp.where(h >= 0, tab_ref[hh, 0], 0)
            row = jnp.where(h >= 0, (tab_ref[hh, 1] + k_row * LANES) // LANES, 0)
            return (
                pltpu.make_async_copy(ar_ref.at[seg, pl.ds(row, c), :], kbuf.at[slot], sem.at[0, slot]),
                pltpu.make_async_copy(ar_ref.at[seg, pl.ds(row + c, c), :], vbuf.at[slot], sem.at[1, slot]),
            )  # fmt: skip

        def page(j, carry):
            m, l, accs = carry
            slot = j % 2

            @pl.when(j + 1 < n)  # the next page loads while this one is computed
            def _():
                for cp in copies(j + 1, 1 - slot):
                    cp.start()

            for cp in copies(j, slot):
                cp.wait()
            mapped = pt_ref[i, j] >= 0
            # keys below kv_len of a mapped page (others: zeros; a recycled page holds any bits)
            keep = ((j * s_ + key_off) < lim) & mapped  # [C, 1]
            ks = [jnp.where(keep, x, 0.0) for x in words_to(kbuf[slot])]
            vs = [jnp.where(keep, x, 0.0) for x in words_to(vbuf[slot])]
            sc = sum(
                jax.lax.dot_general(
                    qq,
                    kk,
                    (((1,), (1,)), ((), ())),
                    precision=jax.lax.Precision.HIGHEST,
                    preferred_element_type=F32,
                )  # fmt: skip
                for qq, kk in zip(qs, ks, strict=True)
            ) * jnp.float32(scale)  # [R, C]
            pos = j * s_ + coff  # [1, C]
            mask = (pos < lim) & (pos <= rpos) & (chead == rhead)
            sc = jnp.where(mask, sc, NEG)
            m_new = jnp.maximum(m, jnp.max(sc, axis=1, keepdims=True))
            alpha = jnp.exp(m - m_new)
            p = jnp.where(mask, jnp.exp(sc - m_new), 0.0)
            l = l * alpha + jnp.sum(p, axis=1, keepdims=True)
            accs = [
                a * alpha
                + jnp.dot(p, vv, precision=jax.lax.Precision.HIGHEST, preferred_element_type=F32)
                for a, vv in zip(accs, vs, strict=True)
            ]
            return m_new, l, accs

        n = (lim + s_ - 1) // s_

        @pl.when(n > 0)
        def _():
            for cp in copies(0, 0):
                cp.start()

        init = (
            jnp.full((r, 1), NEG, F32),
            jnp.zeros((r, 1), F32),
            [jnp.zeros((r, LANES), F32) for _ in range(parts)],
        )
        _, l, accs = jax.lax.fori_loop(0, n, page, init)
        inv = jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)
        for p_, a in enumerate(accs):
            o_ref[p_] = a * inv

    need = vmem_bytes(
        [((parts, r, LANES), F32)] * 2 + [((r, 1), jnp.int32)] * 2 + [((1, c), jnp.int32)] * 2,
        scratch=[((2, c, LANES), jnp.uint32)] * 2,
        temporaries=[((r, c), F32)] * 3 + [((c, LANES), F32)] * (2 * parts),
    )
    qspec = pl.BlockSpec((parts, None, r, LANES), lambda i, *_: (0, i, 0, 0))
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(b,),
            in_specs=[
                qspec,
                pl.BlockSpec((None, r, 1), lambda i, *_: (i, 0, 0)),
                pl.BlockSpec((r, 1), lambda i, *_: (0, 0)),
                pl.BlockSpec((1, c), lambda i, *_: (0, 0)),
                pl.BlockSpec((1, c), lambda i, *_: (0, 0)),
                any_spec(),
            ],
            out_specs=qspec,
            scratch_shapes=[
                pltpu.VMEM((2, c, LANES), jnp.uint32),
                pltpu.VMEM((2, c, LANES), jnp.uint32),
                pltpu.SemaphoreType.DMA((2, 2)),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((parts, b, r, LANES), F32),
        compiler_params=compiler_params("paged_attention_arena", need, ("parallel",)),
        interpret=interpret_params(interpret),
        name="paged_attention_arena_tpu",
    )(
        page_handles.astype(jnp.int32),
        table.astype(jnp.int32),
        kv_len.astype(jnp.int32),
        qp,
        row_pos,
        row_head,
        col_off,
        col_head,
        rows,
    )
    o = jnp.stack(list(out), axis=-1).reshape(b, t, hq, d)  # interleave the even/odd columns
    return o.astype(q.dtype)
