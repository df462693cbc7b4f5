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

Grid ``(B,)``: one program per batch row. Its query rows are stacked per KV head (grouped
heads: query head ``h`` reads KV head ``h // (Hq / Hkv)``): KV head ``k``'s ``M`` rows (its
group's heads times the row's queries, padded to a multiple of 8) are the ``M`` dimension of
the dots against that head's keys only, so no score pairs a query with another head's keys. A
``fori_loop`` over steps of ``SP = 128 / S`` pages (fewer when the page table is shorter)
runs the online softmax in f32: a step's pages come in by whole-page DMAs (``C = S * Hkv`` lane
rows each, key ``s`` of head ``k`` at row ``s * Hkv + k``), and each KV head reads its ``KB =
SP * S`` keys as a strided slice of the step's buffer (rows ``k, k + Hkv, ...``), one ``[M,
KB]`` score block 128 lanes wide; the next step's DMAs run while this step is computed (two
buffers each, one semaphore per buffer). Dots: a bf16 cache's K and V (and bf16 queries and
draft K/V) are exact in bf16 and enter the MXU as they are, the f32 operand against them as
hi and lo bf16 halves (:func:`pallas_kernels.tpu._common.dot`, about ``2^-16`` relative: one
pass for ``q k^T``, two for ``p v`` at bf16 queries); two f32 operands (an f32 cache) multiply
at ``Precision.HIGHEST``. Keys at or past ``kv_len`` (a recycled page holds arbitrary bits)
read as zero values and score nothing; an unmapped page (handle ``-1``) below ``kv_len`` is
written as zeros (no DMA) that score 0, as the XLA path's gather of it; a query row with no key
(a padding row) returns zeros.

Row orders: both kernels stack rows head-major, so the rows of one KV head are contiguous: the
paged kernel ``R = Hkv * M`` rows ``k * M + g * T + t`` (query head ``k * group + g``, query
``t``; ``M``: ``group * T`` padded to a multiple of 8, padding rows see no key), the tree
kernel ``R = Hq * Np`` rows ``h * Np + n`` (``Np``: ``N`` padded to a multiple of 8; ``M =
group * Np``). After the pages, the tree kernel takes each KV head's rows against that head's
``Np`` draft keys (one ``[group Np, Np]`` score block, the path mask repeated over the group)
and finishes the same online softmax.

VMEM: the ``[P, R, 128]`` f32 query and output blocks, two double ``[SP C, 128]`` word buffers,
every head's accumulators and one head's ``[M, KB]`` scores and ``[KB, 128]`` keys and values;
the tree kernel adds the ``[P, Hkv Np, 128]`` f32 draft K and V blocks, the ``[Np, Np]`` mask
and the ``[group Np, Np]`` tree scores. Stated per call in ``vmem_limit_bytes``
(:func:`paged_attention_vmem`, :func:`tree_attention_vmem`; at Qwen3.5's geometry, 16 query
heads on 2 KV heads of 256 in bf16, 16-token pages: about 1.3 MiB for decode, 3.3 MiB for a
16-token prefill chunk, 11 MiB for a tree of ``N = 64``, 20 MiB at ``N = 128``, about twice
the tree's at 32 query heads); a call over the 64 MiB cap raises ``ValueError``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tpu._arena import any_spec, lane_rows
from pallas_kernels.tpu._common import (
    BF16,
    F32,
    LANES,
    SUBLANES,
    compiler_params,
    dot,
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


def _dot(a, b, *, trans_b=False):
    """``a b`` (``a b^T``) in f32: at ``Precision.HIGHEST`` when both are f32; with a bf16
    operand (exact values), the other's hi and lo bf16 halves, one MXU pass each
    (:func:`pallas_kernels.tpu._common.dot`, about ``2^-16`` relative)."""
    if a.dtype == F32 and b.dtype == F32:
        dims = (((1,), (1 if trans_b else 0,)), ((), ()))
        return jax.lax.dot_general(a, b, dims, precision=HIGHEST, preferred_element_type=F32)
    return dot(a, b, "bf16x3", trans_b=trans_b)


def _operand(x, exact: bool):
    """An f32 dot operand as bf16 when its values are bf16 (``exact``: a bf16 input or
    cache), else as it is."""
    return x.astype(BF16) if exact else x


def _softmax_step(state, sc, seen, vs):
    """One online-softmax step of ``(m, l, accs)`` over the scores ``sc [M, KB]`` where
    ``seen`` and the values ``vs`` (one ``[KB, 128]`` per part)."""
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


def _init(m: int, parts: int):
    return (
        jnp.full((m, 1), NEG, F32),
        jnp.zeros((m, 1), F32),
        [jnp.zeros((m, LANES), F32) for _ in range(parts)],
    )


def _committed(i, lim, qs, refs, *, seen, parts, page_size, hkv, k_row, scale):
    """Per KV head ``k``, the ``(m, l, accs)`` of the online softmax of its query rows
    (``qs[k]``: one ``[M, 128]`` dot operand per part) over row ``i``'s pages
    below ``lim`` (module docstring). ``refs``: ``(page table, table, arena, K buffers, V
    buffers, DMA semaphores)``; ``seen(k, pos)``: the bool ``[M, KB]`` mask of the key positions
    ``pos [1, KB]`` of a step for KV head ``k``."""
    pt_ref, tab_ref, ar_ref, kbuf, vbuf, sem = refs
    c = page_size * hkv  # lane rows of one page's K (or V)
    pages = kbuf.shape[1] // c  # pages a step
    kb = pages * page_size  # keys of a step, per KV head
    n = (lim + page_size - 1) // page_size  # the row's pages
    steps = (n + pages - 1) // pages

    def each_page(js, body):
        """``body(p, handle)`` for the pages ``p`` of step ``js`` below ``n`` (the rest of
        the step's buffer is stale, masked by ``kv_len``)."""

        def run(p, carry):
            @pl.when(js * pages + p < n)
            def _():
                body(p, pt_ref[i, js * pages + p])

            return carry

        jax.lax.fori_loop(0, pages, run, 0)

    def start(js, slot):
        """Step ``js``'s K and V DMAs into buffer ``slot``, one semaphore per buffer; an
        unmapped page is written as zeros (scores 0, as the XLA path's gather of it)."""

        def body(p, h):
            dst = pl.ds(pl.multiple_of(p * c, c), c)

            @pl.when(h >= 0)
            def _():
                seg, row = tab_ref[h, 0], (tab_ref[h, 1] + k_row * LANES) // LANES
                for kv, buf in enumerate((kbuf, vbuf)):  # V's rows follow K's
                    src = ar_ref.at[seg, pl.ds(row + kv * c, c), :]
                    pltpu.make_async_copy(src, buf.at[slot, dst, :], sem.at[kv, slot]).start()

            @pl.when(h < 0)
            def _():
                kbuf[slot, dst, :] = jnp.zeros((c, LANES), jnp.uint32)
                vbuf[slot, dst, :] = jnp.zeros((c, LANES), jnp.uint32)

        each_page(js, body)

    def wait(js, slot):
        def body(p, h):
            @pl.when(h >= 0)
            def _():
                for kv, buf in enumerate((kbuf, vbuf)):  # one page's bytes off the semaphore
                    src, dst = ar_ref.at[0, pl.ds(0, c), :], buf.at[slot, pl.ds(0, c), :]
                    pltpu.make_async_copy(src, dst, sem.at[kv, slot]).wait()

        each_page(js, body)

    key_row = jax.lax.broadcasted_iota(jnp.int32, (1, kb), 1)
    key_col = jax.lax.broadcasted_iota(jnp.int32, (kb, 1), 0)

    def step(js, state):
        slot = js % 2

        @pl.when(js + 1 < steps)  # the next step's pages load while this one is computed
        def _():
            start(js + 1, 1 - slot)

        wait(js, slot)
        # values of keys at or past kv_len read as zeros (a recycled page holds any bits; their
        # scores, NaN included, are masked by seen)
        keep = (js * kb + key_col) < lim  # [KB, 1]
        pos = js * kb + key_row
        out = []
        for k in range(hkv):  # KV head k's keys: rows k, k + Hkv, ... of the step's pages
            rows = pl.ds(k, kb, stride=hkv) if hkv > 1 else pl.ds(0, kb)
            vw = jnp.where(keep, vbuf[slot, rows, :], jnp.uint32(0))
            ks = [_operand(x, parts == 2) for x in _words_to(kbuf[slot, rows, :], parts)]
            vs = [_operand(x, parts == 2) for x in _words_to(vw, parts)]
            sc = sum(_dot(qq, kk, trans_b=True) for qq, kk in zip(qs[k], ks, strict=True))
            out.append(_softmax_step(state[k], sc * jnp.float32(scale), seen(k, pos), vs))
        return out

    @pl.when(steps > 0)
    def _():
        start(0, 0)

    init = [_init(q[0].shape[0], parts) for q in qs]
    return jax.lax.fori_loop(0, steps, step, init)


def _padded_nodes(n: int) -> int:
    return -(-n // SUBLANES) * SUBLANES


def pages_per_step(page_size: int, mp: int) -> int:
    """Pages one step of the page loop reads: a 128-key score block per KV head (fewer when
    the page table is shorter; at least one page)."""
    return max(1, min(LANES // page_size, mp))


def _arena_call(kernel, operands, specs, *, b, parts, r, c, pages, need, name, interpret):
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
                pltpu.VMEM((2, pages * c, LANES), jnp.uint32),
                pltpu.VMEM((2, pages * c, LANES), jnp.uint32),
                pltpu.SemaphoreType.DMA((2, 2)),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((parts, b, r, LANES), F32),
        compiler_params=compiler_params(name, need, ("parallel",)),
        interpret=interpret_params(interpret),
        name=f"{name}_tpu",
    )(pt.astype(jnp.int32), tab.astype(jnp.int32), kv_len.astype(jnp.int32), *blocked, arena)


def _page_vmem(parts: int, r: int, m: int, page_size: int, hkv: int, pages: int):
    """``(blocks, scratch, temporaries)`` of the page loop for :func:`vmem_bytes`: ``r`` query
    rows, ``m`` of them per KV head, ``pages`` pages of ``page_size`` tokens a step."""
    c, kb = page_size * hkv, pages * page_size
    return (
        [((parts, r, LANES), F32)] * 2,
        [((2, pages * c, LANES), jnp.uint32)] * 2,
        [((r, LANES), F32)] * (2 * parts)  # every head's queries and accumulators
        + [((r, 1), F32)] * 2
        + [((m, kb), F32)] * 4  # one head's scores, probabilities (two halves), mask
        + [((kb, LANES), jnp.uint32)] * 2  # its K and V words
        + [((kb, LANES), F32)] * (4 * parts),  # their values, as f32 and bf16
    )


def paged_attention_vmem(
    t: int, hq: int, hkv: int, page_size: int, kv_dtype, max_pages: int = LANES
) -> int:
    """VMEM bytes of :func:`paged_attention_arena` for ``t`` queries a row, ``hq`` query heads
    on ``hkv`` KV heads, ``page_size``-token pages of ``kv_dtype``, a page table of
    ``max_pages`` pages a row (what it passes as its budget)."""
    parts, pages = _parts(kv_dtype), pages_per_step(page_size, max_pages)
    m = _padded_nodes((hq // hkv) * t)
    blocks, scratch, temps = _page_vmem(parts, hkv * m, m, page_size, hkv, pages)
    blocks += [((m, 1), jnp.int32)]
    return vmem_bytes(blocks, scratch, temps)


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
    ``[B, T, Hq, D]`` in q's dtype. ``interpret``: TPU interpret mode (any backend). VMEM:
    :func:`paged_attention_vmem`."""
    check_paged(
        q, arena, table, page_handles, kv_len, q_pos,
        kv_heads=kv_heads, kv_offset=kv_offset, kv_dtype=kv_dtype,
    )  # fmt: skip
    b, t, hq, d = q.shape
    parts, hkv, mp = _parts(kv_dtype), kv_heads, page_handles.shape[1]
    group = hq // hkv
    gt = group * t
    m = _padded_nodes(gt)  # query rows of one KV head: its group's heads x T, padded
    c, pages = page_size * hkv, pages_per_step(page_size, mp)
    # rows k * M + g * T + t: KV head k's group of query heads, then the queries
    x = jnp.moveaxis(q.reshape(b, t, hkv, group, d), 1, 3).reshape(b, hkv, gt, d)
    x = jnp.pad(x, [(0, 0), (0, 0), (0, m - gt), (0, 0)])
    qp = _split(x.reshape(b, hkv * m, d), parts)  # [P, B, R, 128]
    row_pos = jnp.tile(q_pos.astype(jnp.int32), (1, group))  # [B, G T]: row g T + t
    row_pos = jnp.pad(row_pos, [(0, 0), (0, m - gt)], constant_values=-1)[..., None]
    k_row = kv_offset // LANES + 2 * layer * c  # the layer's K rows in a unit; V follows
    exact = q.dtype == BF16

    def kernel(pt_ref, tab_ref, len_ref, q_ref, rp_ref, ar_ref, o_ref, kbuf, vbuf, sem):
        i = pl.program_id(0)
        lim = len_ref[i]
        rpos = rp_ref[...]  # [M, 1]
        qs = [
            [_operand(q_ref[p, k * m : (k + 1) * m, :], exact) for p in range(parts)]
            for k in range(hkv)
        ]
        states = _committed(
            i, lim, qs, (pt_ref, tab_ref, ar_ref, kbuf, vbuf, sem),
            seen=lambda k, pos: (pos < lim) & (pos <= rpos),
            parts=parts, page_size=page_size, hkv=hkv, k_row=k_row, scale=scale,
        )  # fmt: skip
        for k, state in enumerate(states):
            for p, o in enumerate(_finish(state)):
                o_ref[p, k * m : (k + 1) * m, :] = o

    out = _arena_call(
        kernel,
        (page_handles, table, kv_len, qp, row_pos, lane_rows(arena)),
        [pl.BlockSpec((None, m, 1), lambda i, *_: (i, 0, 0))],
        b=b,
        parts=parts,
        r=hkv * m,
        c=c,
        pages=pages,
        need=paged_attention_vmem(t, hq, hkv, page_size, kv_dtype, mp),
        name="paged_attention_arena",
        interpret=interpret,
    )
    o = _interleave(out).reshape(b, hkv, m, d)[:, :, :gt].reshape(b, hkv, group, t, d)
    return jnp.moveaxis(o, 3, 1).reshape(b, t, hq, d).astype(q.dtype)


def tree_attention_vmem(
    n: int, hq: int, hkv: int, page_size: int, kv_dtype, max_pages: int = LANES
) -> int:
    """VMEM bytes of :func:`tree_attention_arena` for ``n`` draft nodes, ``hq`` query heads on
    ``hkv`` KV heads, ``page_size``-token pages of ``kv_dtype``, a page table of ``max_pages``
    pages a row (what it passes as its budget; over
    :data:`pallas_kernels.tpu._common.VMEM_CAP` the call raises ``ValueError``)."""
    parts, np_ = _parts(kv_dtype), _padded_nodes(n)
    pages, gn = pages_per_step(page_size, max_pages), (hq // hkv) * np_
    blocks, scratch, temps = _page_vmem(parts, hq * np_, gn, page_size, hkv, pages)
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
    hkv, mp = draft_k.shape[2], page_handles.shape[1]
    parts, np_ = _parts(kv_dtype), _padded_nodes(n)
    group = hq // hkv
    c, gn = page_size * hkv, group * np_
    pages = pages_per_step(page_size, mp)

    def head_major(x):  # [B, N, H, D] -> [B, H * Np, D], nodes padded
        x = jnp.pad(x, [(0, 0), (0, np_ - n), (0, 0), (0, 0)])
        return jnp.swapaxes(x, 1, 2).reshape(b, -1, d)

    qp, dkp, dvp = (_split(head_major(x), parts) for x in (q, draft_k, draft_v))
    mask = jnp.pad(draft_mask.astype(jnp.int32), [(0, 0), (0, np_ - n), (0, np_ - n)])
    k_row = kv_offset // LANES + 2 * layer * c
    q_exact, d_exact = q.dtype == BF16, draft_k.dtype == BF16 and draft_v.dtype == BF16

    def kernel(pt_ref, tab_ref, len_ref, q_ref, dk_ref, dv_ref, path_ref, ar_ref, o_ref,
               kbuf, vbuf, sem):  # fmt: skip
        i = pl.program_id(0)
        lim = len_ref[i]
        qs = [
            [_operand(q_ref[p, k * gn : (k + 1) * gn, :], q_exact) for p in range(parts)]
            for k in range(hkv)
        ]
        states = _committed(
            i, lim, qs, (pt_ref, tab_ref, ar_ref, kbuf, vbuf, sem),
            seen=lambda k, pos: pos < lim,
            parts=parts, page_size=page_size, hkv=hkv, k_row=k_row, scale=scale,
        )  # fmt: skip
        path = path_ref[...]  # [Np, Np]
        seen = (jnp.concatenate([path] * group, axis=0) if group > 1 else path) != 0
        for k in range(hkv):  # KV head k's rows: its group's heads, Np nodes each
            rows, keys = slice(k * gn, (k + 1) * gn), slice(k * np_, (k + 1) * np_)
            ks = [_operand(dk_ref[p, keys, :], d_exact) for p in range(parts)]
            sc = sum(_dot(qq, kk, trans_b=True) for qq, kk in zip(qs[k], ks, strict=True))
            state = _softmax_step(
                states[k],
                sc * jnp.float32(scale),
                seen,
                [_operand(dv_ref[p, keys, :], d_exact) for p in range(parts)],
            )
            for p, o in enumerate(_finish(state)):
                o_ref[p, rows, :] = o

    draft_spec = pl.BlockSpec((parts, None, hkv * np_, LANES), lambda i, *_: (0, i, 0, 0))
    out = _arena_call(
        kernel,
        (page_handles, table, kv_len, qp, dkp, dvp, mask, lane_rows(arena)),
        [draft_spec, draft_spec, pl.BlockSpec((None, np_, np_), lambda i, *_: (i, 0, 0))],
        b=b,
        parts=parts,
        r=hq * np_,
        c=c,
        pages=pages,
        need=tree_attention_vmem(n, hq, hkv, page_size, kv_dtype, mp),
        name="tree_attention_arena",
        interpret=interpret,
    )
    o = _interleave(out).reshape(b, hq, np_, d)
    return jnp.swapaxes(o, 1, 2)[:, :n].astype(q.dtype)
