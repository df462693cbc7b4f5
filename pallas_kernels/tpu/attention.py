"""Attention over KV pages inside the serving memory arena as Mosaic TPU kernels, the pages read
in place through the handle table, as :mod:`pallas_kernels.attention.arena` on GPU:

- :func:`paged_attention_arena`: decode and (chunked) prefill, causal in each query's position.
  Query ``t`` of row ``b`` (position ``q_pos[b, t]``) sees the committed keys ``j < kv_len[b]``
  with ``j <= q_pos[b, t]``; the new tokens' K/V are already in the pages.
- :func:`tree_attention_arena`: the tree verify. Draft node ``n`` of row ``b`` sees the
  committed keys ``j < kv_len[b]`` (every node sits at or after them), then the draft keys
  ``m`` with ``draft_mask[b, n, m]`` (its root-to-node path), the draft K/V passed in dense.

Both give the XLA path's ``attend_committed`` over the gathered pages.

Arena addressing (:mod:`pallas_kernels.tpu._arena`: the arena as ``uint32 [segments, rows,
128]`` lane rows). A KV unit is ``[La, 2, S, Hkv, D]`` in the cache dtype, ``kv_offset`` words
into the unit (``serving.arena_spec.ArenaSpec``); row ``b``'s logical page ``j`` is the unit of
``page_handles[b, j]`` at ``table[handle] = (segment, word)``. The kernels need a head row to be
one lane row (``D`` f32 or ``D / 2`` bf16 words = 128: head dim 128 in f32, 256 in bf16, as
Qwen3.5's full attention) and ``kv_offset`` on a row, so one page's K (or V) of one layer is
``S * Hkv`` whole rows, moved by one DMA. A bf16 word holds elements ``2i`` (low half) and
``2i + 1`` (high half): ``bitcast(w << 16)`` and ``bitcast(w & 0xffff0000)`` are the even and
odd columns, exact; the queries (and draft K/V) come split the same way, ``P`` parts of 128
lanes (``P`` = 1 for f32, 2 for bf16), and the output's even and odd columns are interleaved
after the kernel.

Grid ``(B,)``: one program per batch row stacks its ``R`` query rows against every KV head's
keys of a page at once, ``C = S * Hkv`` key rows (row ``s * Hkv + k``), and masks the pairs whose
heads differ (grouped heads: query head ``h`` reads KV head ``h // (Hq / Hkv)``); the rows' heads
(and positions) and the columns' page offsets and heads come in as small int blocks. A
``fori_loop`` over the row's ``ceil(kv_len / S)`` pages runs the online softmax in f32 (dots at
``Precision.HIGHEST``); page ``j + 1``'s K and V DMAs run while page ``j`` is computed (two
buffers each). Keys at or past ``kv_len`` (a recycled page holds arbitrary bits) read as zeros
and score nothing; an unmapped page (handle ``-1``) below ``kv_len`` reads as zeros that score 0,
as the XLA path's gather of it; a query row with no key (a padding row) returns zeros.

Row orders: the paged kernel stacks ``R = T * Hq`` rows ``t * Hq + h``; the tree kernel
``R = Hq * Np`` rows head-major, ``h * Np + n`` (``Np``: ``N`` padded to a multiple of 8), so
the ``group * Np`` rows of one KV head are contiguous. After the pages, the tree kernel takes
each KV head's rows against that head's ``Np`` draft keys (one ``[group Np, Np]`` score block,
the path mask repeated over the group) and finishes the same online softmax.

VMEM: the ``[P, R, 128]`` f32 query and output blocks, two double ``[C, 128]`` word buffers and
the ``[R, C]`` scores; the tree kernel adds the ``[P, Hkv Np, 128]`` f32 draft K and V blocks, the
``[Np, Np]`` mask and the ``[group Np, Np]`` tree scores. Stated per call in
``vmem_limit_bytes`` (:func:`tree_attention_vmem` for the tree kernel; at Qwen3.5's geometry,
16 query heads on 2 KV heads of 256 in bf16, 16-token pages: about 10 MiB at ``N = 64``, 20 MiB
at ``N = 128``, twice that at 32 query heads); a call over the 64 MiB cap raises ``ValueError``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tpu._arena import any_spec, lane_rows
from pallas_kernels.tpu._common import (
    F32,
    LANES,
    SUBLANES,
    compiler_params,
    interpret_params,
    vmem_bytes,
)

NEG = -1e30  # the score of a masked key (finite: exp(NEG - m) is 0, never NaN)
HIGHEST = jax.lax.Precision.HIGHEST


def _parts(dtype) -> int:
    """Values per 32-bit word of the cache: 1 (f32) or 2 (bf16)."""
    d = jnp.dtype(dtype)
    if d == jnp.float32:
        return 1
    if d == jnp.bfloat16:
        return 2
    raise ValueError(f"kv_dtype: the TPU paged attention reads float32 or bfloat16, got {d}")


def _check_arena(q, arena, table, page_handles, kv_len, *, kv_heads, kv_offset, kv_dtype):
    """ValueErrors for queries and arena operands the TPU attention kernels cannot take."""
    if q.ndim != 4:
        raise ValueError(f"q: expected [B, T, Hq, D], got {q.shape}")
    b, _, hq, d = q.shape
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
    if kv_len.shape != (b,):
        raise ValueError(f"kv_len: expected [B] = ({b},), got {kv_len.shape}")


def check_paged(q, arena, table, page_handles, kv_len, q_pos, *, kv_heads, kv_offset, kv_dtype):
    """ValueErrors for inputs :func:`paged_attention_arena` cannot take (before tracing)."""
    _check_arena(
        q, arena, table, page_handles, kv_len,
        kv_heads=kv_heads, kv_offset=kv_offset, kv_dtype=kv_dtype,
    )  # fmt: skip
    b, t = q.shape[:2]
    if q_pos.shape != (b, t):
        raise ValueError(f"q_pos: expected [B, T] = ({b}, {t}), got {q_pos.shape}")


def check_tree(
    q, arena, table, page_handles, kv_len, draft_k, draft_v, draft_mask, *, kv_offset, kv_dtype
):
    """ValueErrors for inputs :func:`tree_attention_arena` cannot take (before tracing)."""
    if draft_k.ndim != 4:
        raise ValueError(f"draft_k: expected [B, N, Hkv, D], got {draft_k.shape}")
    _check_arena(
        q, arena, table, page_handles, kv_len,
        kv_heads=draft_k.shape[2], kv_offset=kv_offset, kv_dtype=kv_dtype,
    )  # fmt: skip
    b, n, _, d = q.shape
    for name, x in (("draft_k", draft_k), ("draft_v", draft_v)):
        if x.shape != (b, n, draft_k.shape[2], d):
            raise ValueError(
                f"{name}: expected [B, N, Hkv, D] = {(b, n, draft_k.shape[2], d)}, got {x.shape}"
            )
    if draft_mask.shape != (b, n, n):
        raise ValueError(f"draft_mask: expected [B, N, N] = {(b, n, n)}, got {draft_mask.shape}")


def _split(x, parts: int):
    """f32 ``[..., 128 P]`` -> ``[P, ..., 128]``: the even and odd columns for bf16 (P = 2)."""
    x = x.astype(F32)
    return jnp.stack([x[..., i::parts] for i in range(parts)])


def _interleave(out):
    """``[P, ..., 128]`` -> ``[..., 128 P]``, the inverse of :func:`_split`."""
    return jnp.stack(list(out), axis=-1).reshape(*out.shape[1:-1], -1)


def _words_to(w, parts: int):
    """``uint32`` words -> the f32 values: one array (f32) or the even and odd columns (bf16)."""
    if parts == 1:
        return [jax.lax.bitcast_convert_type(w, F32)]
    even = jax.lax.bitcast_convert_type(jax.lax.shift_left(w, jnp.uint32(16)), F32)
    odd = jax.lax.bitcast_convert_type(w & jnp.uint32(0xFFFF0000), F32)
    return [even, odd]


def _dot_nt(a, b):
    """``a b^T`` in f32."""
    dims = (((1,), (1,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=HIGHEST, preferred_element_type=F32)


def _dot(a, b):
    return jnp.dot(a, b, precision=HIGHEST, preferred_element_type=F32)


def _softmax_step(state, sc, seen, vs):
    """One online-softmax step of ``(m, l, accs)`` over the scores ``sc [R, M]`` where
    ``seen`` and the values ``vs`` (one ``[M, 128]`` per part)."""
    m, l, accs = state
    sc = jnp.where(seen, sc, NEG)
    m_new = jnp.maximum(m, jnp.max(sc, axis=1, keepdims=True))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(seen, jnp.exp(sc - m_new), 0.0)
    l = l * alpha + jnp.sum(p, axis=1, keepdims=True)
    accs = [a * alpha + _dot(p, v) for a, v in zip(accs, vs, strict=True)]
    return m_new, l, accs


def _finish(state):
    """The outputs ``acc / l`` of an online softmax (zeros for a row that saw no key)."""
    _, l, accs = state
    inv = jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)
    return [a * inv for a in accs]


def _committed(i, lim, qs, refs, *, seen, parts, page_size, k_row, scale):
    """``(m, l, accs)`` of the online softmax of the stacked query rows ``qs`` (one ``[R, 128]``
    per part) over row ``i``'s pages below ``lim`` (module docstring). ``refs``: ``(page table,
    table, arena, K buffers, V buffers, DMA semaphores, column offsets [1, C])``; ``seen(pos)``:
    the bool ``[R, C]`` mask of the key positions ``pos [1, C]`` of a page."""
    pt_ref, tab_ref, ar_ref, kbuf, vbuf, sem, co_ref = refs
    c = kbuf.shape[1]
    r = qs[0].shape[0]
    coff = co_ref[...]  # [1, C]
    key_off = jnp.transpose(coff)  # [C, 1]: each key row's offset in its page

    def copies(j, slot):
        """Page ``j``'s K and V DMAs into buffer ``slot`` (an unmapped page: row 0 of segment
        0, masked out after the load)."""
        h = pt_ref[i, j]
        hh = jnp.maximum(h, 0)
        seg = jnp.where(h >= 0, tab_ref[hh, 0], 0)
        row = jnp.where(h >= 0, (tab_ref[hh, 1] + k_row * LANES) // LANES, 0)
        return (
            pltpu.make_async_copy(ar_ref.at[seg, pl.ds(row, c), :], kbuf.at[slot], sem.at[0, slot]),
            pltpu.make_async_copy(ar_ref.at[seg, pl.ds(row + c, c), :], vbuf.at[slot], sem.at[1, slot]),
        )  # fmt: skip

    n = (lim + page_size - 1) // page_size

    def page(j, state):
        slot = j % 2

        @pl.when(j + 1 < n)  # the next page loads while this one is computed
        def _():
            for cp in copies(j + 1, 1 - slot):
                cp.start()

        for cp in copies(j, slot):
            cp.wait()
        # keys below lim of a mapped page (others: zeros; a recycled page holds any bits)
        keep = ((j * page_size + key_off) < lim) & (pt_ref[i, j] >= 0)  # [C, 1]
        ks = [jnp.where(keep, x, 0.0) for x in _words_to(kbuf[slot], parts)]
        vs = [jnp.where(keep, x, 0.0) for x in _words_to(vbuf[slot], parts)]
        sc = sum(_dot_nt(qq, kk) for qq, kk in zip(qs, ks, strict=True)) * jnp.float32(scale)
        return _softmax_step(state, sc, seen(j * page_size + coff), vs)

    @pl.when(n > 0)
    def _():
        for cp in copies(0, 0):
            cp.start()

    init = (
        jnp.full((r, 1), NEG, F32),
        jnp.zeros((r, 1), F32),
        [jnp.zeros((r, LANES), F32) for _ in range(parts)],
    )
    return jax.lax.fori_loop(0, n, page, init)


def _page_columns(page_size: int, hkv: int):
    """The int ``[1, C]`` page offset and KV head of each key row ``s * Hkv + k`` of a page."""
    col = jnp.arange(page_size * hkv, dtype=jnp.int32)
    return (col // hkv)[None, :], (col % hkv)[None, :]


def _arena_call(kernel, operands, specs, *, b, parts, r, c, need, name, interpret):
    """The ``pallas_call`` on the ``(B,)`` grid: scalar-prefetched ``(page table, table,
    kv_len)``, then the blocked ``operands`` with their ``specs`` (the ``[P, B, R, 128]``
    queries first), the arena last; the f32 ``[P, B, R, 128]`` output."""
    pt, tab, kv_len, *blocked, arena = operands
    qspec = pl.BlockSpec((parts, None, r, LANES), lambda i, *_: (0, i, 0, 0))
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(b,),
            in_specs=[qspec, *specs, any_spec()],
            out_specs=qspec,
            scratch_shapes=[
                pltpu.VMEM((2, c, LANES), jnp.uint32),
                pltpu.VMEM((2, c, LANES), jnp.uint32),
                pltpu.SemaphoreType.DMA((2, 2)),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((parts, b, r, LANES), F32),
        compiler_params=compiler_params(name, need, ("parallel",)),
        interpret=interpret_params(interpret),
        name=f"{name}_tpu",
    )(pt.astype(jnp.int32), tab.astype(jnp.int32), kv_len.astype(jnp.int32), *blocked, arena)


def _page_vmem(parts: int, r: int, c: int) -> tuple[list, list, list]:
    """``(blocks, scratch, temporaries)`` of the page loop for :func:`vmem_bytes`."""
    return (
        [((parts, r, LANES), F32)] * 2 + [((r, 1), jnp.int32)] * 2 + [((1, c), jnp.int32)] * 2,
        [((2, c, LANES), jnp.uint32)] * 2,
        [((r, c), F32)] * 3 + [((c, LANES), F32)] * (2 * parts) + [((r, LANES), F32)] * parts,
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
    parts, hkv = _parts(kv_dtype), kv_heads
    group = hq // hkv
    r, c = t * hq, page_size * hkv  # query rows, key rows of a page
    qp = _split(q.reshape(b, r, d), parts)  # [P, B, R, 128]
    row_pos = jnp.repeat(q_pos.astype(jnp.int32), hq, axis=1)[..., None]  # [B, R, 1]
    row_head = jnp.tile(jnp.arange(hq, dtype=jnp.int32) // group, t)[:, None]  # [R, 1]
    col_off, col_head = _page_columns(page_size, hkv)
    k_row = kv_offset // LANES + 2 * layer * c  # the layer's K rows in a unit; V follows

    def kernel(pt_ref, tab_ref, len_ref, q_ref, rp_ref, rh_ref, co_ref, ch_ref, ar_ref, o_ref,
               kbuf, vbuf, sem):  # fmt: skip
        i = pl.program_id(0)
        lim = len_ref[i]
        rpos, rhead, chead = rp_ref[...], rh_ref[...], ch_ref[...]
        state = _committed(
            i, lim, [q_ref[p] for p in range(parts)],
            (pt_ref, tab_ref, ar_ref, kbuf, vbuf, sem, co_ref),
            seen=lambda pos: (pos < lim) & (pos <= rpos) & (chead == rhead),
            parts=parts, page_size=page_size, k_row=k_row, scale=scale,
        )  # fmt: skip
        for p, o in enumerate(_finish(state)):
            o_ref[p] = o

    blocks, scratch, temps = _page_vmem(parts, r, c)
    out = _arena_call(
        kernel,
        (page_handles, table, kv_len, qp, row_pos, row_head, col_off, col_head, lane_rows(arena)),
        [
            pl.BlockSpec((None, r, 1), lambda i, *_: (i, 0, 0)),
            pl.BlockSpec((r, 1), lambda i, *_: (0, 0)),
            pl.BlockSpec((1, c), lambda i, *_: (0, 0)),
            pl.BlockSpec((1, c), lambda i, *_: (0, 0)),
        ],
        b=b,
        parts=parts,
        r=r,
        c=c,
        need=vmem_bytes(blocks, scratch, temps),
        name="paged_attention_arena",
        interpret=interpret,
    )
    return _interleave(out).reshape(b, t, hq, d).astype(q.dtype)


def _padded_nodes(n: int) -> int:
    return -(-n // SUBLANES) * SUBLANES


def tree_attention_vmem(n: int, hq: int, hkv: int, page_size: int, kv_dtype) -> int:
    """VMEM bytes of :func:`tree_attention_arena` for ``n`` draft nodes, ``hq`` query heads on
    ``hkv`` KV heads, ``page_size``-token pages of ``kv_dtype`` (what it passes as its budget;
    over :data:`pallas_kernels.tpu._common.VMEM_CAP` the call raises ``ValueError``)."""
    parts, np_ = _parts(kv_dtype), _padded_nodes(n)
    r, c, gn = hq * np_, page_size * hkv, (hq // hkv) * np_
    blocks, scratch, temps = _page_vmem(parts, r, c)
    blocks += [((parts, hkv * np_, LANES), F32)] * 2 + [((np_, np_), jnp.int32)]
    temps += [((gn, np_), F32)] * 3 + [((gn, np_), jnp.int32)]
    return vmem_bytes(blocks, scratch, temps)


@functools.partial(
    jax.jit,
    static_argnames=("layer", "kv_offset", "page_size", "kv_dtype", "scale", "interpret"),
)
def tree_attention_arena(
    q,
    arena,
    table,
    page_handles,
    kv_len,
    draft_k,
    draft_v,
    draft_mask,
    *,
    layer: int,
    kv_offset: int,
    page_size: int,
    kv_dtype,
    scale: float,
    interpret: bool = False,
):
    """Tree attention of the draft nodes ``q [B, N, Hq, D]`` over attention layer ``layer``'s
    committed pages of each row in the arena (``page_handles int [B, MP]``, ``-1`` = unmapped;
    keys ``j < kv_len[b]``), then the draft ``draft_k, draft_v [B, N, Hkv, D]`` where
    ``draft_mask bool [B, N, N]`` (node ``n`` sees node ``m`` on its path), one softmax over
    both (module doc); returns ``[B, N, Hq, D]`` in q's dtype. Same arguments as
    :func:`pallas_kernels.attention.arena.tree_attention`; ``kv_dtype`` is the cache dtype in
    the units (float32 or bfloat16), the draft K/V may be any float dtype (taken as f32).
    ``interpret``: TPU interpret mode (any backend). VMEM: :func:`tree_attention_vmem`."""
    check_tree(
        q, arena, table, page_handles, kv_len, draft_k, draft_v, draft_mask,
        kv_offset=kv_offset, kv_dtype=kv_dtype,
    )  # fmt: skip
    b, n, hq, d = q.shape
    hkv = draft_k.shape[2]
    parts, np_ = _parts(kv_dtype), _padded_nodes(n)
    group = hq // hkv
    r, c, gn = hq * np_, page_size * hkv, group * np_

    def head_major(x):  # [B, N, H, D] -> [B, H * Np, D], nodes padded
        x = jnp.pad(x, [(0, 0), (0, np_ - n), (0, 0), (0, 0)])
        return jnp.swapaxes(x, 1, 2).reshape(b, -1, d)

    qp, dkp, dvp = (_split(head_major(x), parts) for x in (q, draft_k, draft_v))
    mask = jnp.pad(draft_mask.astype(jnp.int32), [(0, 0), (0, np_ - n), (0, np_ - n)])
    row_head = (jnp.arange(r, dtype=jnp.int32) // gn)[:, None]  # [R, 1]
    col_off, col_head = _page_columns(page_size, hkv)
    k_row = kv_offset // LANES + 2 * layer * c

    def kernel(pt_ref, tab_ref, len_ref, q_ref, dk_ref, dv_ref, path_ref, rh_ref, co_ref, ch_ref,
               ar_ref, o_ref, kbuf, vbuf, sem):  # fmt: skip
        i = pl.program_id(0)
        lim = len_ref[i]
        rhead, chead = rh_ref[...], ch_ref[...]
        m, l, accs = _committed(
            i, lim, [q_ref[p] for p in range(parts)],
            (pt_ref, tab_ref, ar_ref, kbuf, vbuf, sem, co_ref),
            seen=lambda pos: (pos < lim) & (chead == rhead),
            parts=parts, page_size=page_size, k_row=k_row, scale=scale,
        )  # fmt: skip
        path = path_ref[...]  # [Np, Np]
        seen = (jnp.concatenate([path] * group, axis=0) if group > 1 else path) != 0
        for k in range(hkv):  # KV head k's rows: its group's heads, Np nodes each
            rows, keys = slice(k * gn, (k + 1) * gn), slice(k * np_, (k + 1) * np_)
            sc = sum(_dot_nt(q_ref[p, rows, :], dk_ref[p, keys, :]) for p in range(parts))
            state = _softmax_step(
                (m[rows], l[rows], [a[rows] for a in accs]),
                sc * jnp.float32(scale),
                seen,
                [dv_ref[p, keys, :] for p in range(parts)],
            )
            for p, o in enumerate(_finish(state)):
                o_ref[p, rows, :] = o

    draft_spec = pl.BlockSpec((parts, None, hkv * np_, LANES), lambda i, *_: (0, i, 0, 0))
    out = _arena_call(
        kernel,
        (
            page_handles,
            table,
            kv_len,
            qp,
            dkp,
            dvp,
            mask,
            row_head,
            col_off,
            col_head,
            lane_rows(arena),
        ),
        [
            draft_spec,
            draft_spec,
            pl.BlockSpec((None, np_, np_), lambda i, *_: (i, 0, 0)),
            pl.BlockSpec((r, 1), lambda i, *_: (0, 0)),
            pl.BlockSpec((1, c), lambda i, *_: (0, 0)),
            pl.BlockSpec((1, c), lambda i, *_: (0, 0)),
        ],
        b=b,
        parts=parts,
        r=r,
        c=c,
        need=tree_attention_vmem(n, hq, hkv, page_size, kv_dtype),
        name="tree_attention_arena",
        interpret=interpret,
    )
    o = _interleave(out).reshape(b, hq, np_, d)
    return jnp.swapaxes(o, 1, 2)[:, :n].astype(q.dtype)
