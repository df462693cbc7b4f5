"""Paged attention with the KV pages inside the memory manager's arena, read in place through
the handle table: no gather of the pages into a per-layer buffer.

Two entry points share one kernel body (page loop, word loads, online softmax):

- :func:`tree_attention`: the tree verify, same math as :mod:`pallas_kernels.attention.kernel`:
  every node sees the committed keys ``j < kv_len``, then its path's draft K/V (``draft_mask``);
- :func:`paged_attention`: calls without draft tokens (decode, prefill, chunked prefill):
  query ``t`` of row ``b`` at position ``q_pos[b, t]`` sees the committed keys
  ``j < kv_len[b]`` with ``j <= q_pos[b, t]`` (the K/V of the new tokens are already written
  into the pages); same result as the XLA path's ``attend`` over the gathered pages.

A KV unit of the arena is ``[La, 2, S, Hkv, D]`` in the cache dtype
(``serving.arena_spec.ArenaSpec``), starting ``kv_offset`` words into the unit; row
``b``'s logical page ``j`` is the unit of handle ``page_handles[b, j]``, found at
``table[handle] = (segment, word)``. K and V are read as ``uint32`` words:

- f32 caches: the words are the values (bitcast);
- bf16 caches: a word holds elements ``2i`` (low half) and ``2i + 1`` (high half), and a bf16
  value is the top half of the f32 with the same value, so ``bitcast(w << 16)`` and
  ``bitcast(w & 0xffff0000)`` are the even and odd columns exactly. The kernel never
  interleaves them: ``q k^T = q_even k_even^T + q_odd k_odd^T`` with ``q`` read at stride 2,
  and the output's even and odd columns are accumulated and stored at stride 2.

Programs and tiles (grouped-query packing). One program per (batch row, KV head ``hk``, query
block[, key split]); its query tile stacks the ``group = Hq / Hkv`` query heads that share KV
head ``hk``: row ``r = i * group + g`` is query ``i`` of the block (``block_q`` queries) in
head ``hk * group + g``. Each K/V tile is thus loaded once for all the heads that read it, and
decode (one query) has ``group`` real rows. The rows are padded to a power of two ``>= 16``
(Triton's dots want ``M >= 16``) with copies of the last real row, which store into spare
slots past the output, dropped. The q rows are gathered from ``[B, T, Hq, D]`` and the output
rows scattered back by element index.

Each loop step covers ``pages_per_step`` consecutive logical pages, ``pages_per_step * S``
keys: key row ``k`` of the step lies in page ``j * pages_per_step + k // S`` and looks up that
page's own handle, segment and word, so the ``[keys, D / parts]`` word-index tile has one base
per row; the next step's handles and table entries are looked up while the current step's
tiles load. K and V are one masked indexed load each: positions at or past the block's causal
bound (at most ``kv_len``; a recycled page holds arbitrary bits, NaN patterns included) and
unmapped pages (handle ``-1``) read as zeros, as the XLA path's gather of them. A zero key
below a query's limit scores 0 (as XLA's); every other position at or past the limit gets the
score ``NEG`` (``-1e30``, finite), so it contributes nothing. The page table is padded with
``-1`` to a power of two that is a multiple of ``pages_per_step``. A page size that is a
multiple of 16 but not a power of two (a page enlarged to hold a recurrent state, as a padded
unified pool makes it) takes key tiles of the default size instead: key row ``k`` of step
``j`` is position ``p = j * keys + k``, in page ``p // S`` at row ``p % S``, so a step may
start and end inside a page.

Key splits (:func:`paged_attention`, ``num_splits``): a fourth grid axis splits each program's
loop steps into contiguous runs of whole steps. A program whose causal bound takes ``n`` steps
walks, as split ``s``, steps ``s * c`` to ``min((s + 1) * c, n)`` with
``c = ceil(n / num_splits)`` (none past the last step: a split wholly past ``kv_len`` or the
block's bound walks nothing), and stores its unnormalised f32 accumulator and its softmax max
``m`` and sum ``l``; jnp after the kernel (small XLA fusions) merges the splits as the loop
would: ``m* = max_s m_s``, ``out = sum_s exp(m_s - m*) acc_s / sum_s exp(m_s - m*) l_s``, and
the uniform softmax where no split saw a key. A masked score is the finite ``NEG``, so a split
that saw no key weighs ``exp(NEG - m*)``, 0 beside one that did, never ``exp(-inf + inf)``.
The automatic count serves decode at small batch: a call with one query block per (row, KV
head) on a grid of ``P < TARGET_PROGRAMS`` programs takes ``ceil(TARGET_PROGRAMS / P)`` splits,
at most the page table's ``ceil(MP / pages_per_step)`` steps; any other call (prefill, large
batches) one, the single loop, computed as without the axis.

Dots: with bf16 queries over a bf16 cache and ``D >= 32``, ``q k^T`` takes bf16 operands (the
even and odd halves are exact bf16 values) with f32 accumulation, and ``p v`` takes ``p``
rounded to bf16 (flash-attention practice); the softmax statistics and the accumulator stay
f32 (a smaller ``D`` would give the bf16 dots a contraction under 16, which the GPU's Triton
dot does not compute right). f32 queries take f32 operands at ``Precision.HIGHEST``; other
combinations f32 operands at the default precision. The score scale multiplies the f32 dot.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.attention.kernel import (
    NEG,
    TreeAttentionBlocks,
    _call_args,
    _dot_nn,
    _dot_nt,
    _next_pow2,
    _pad_nodes,
)

F32 = jnp.float32
BF16 = jnp.bfloat16
MIN_ROWS = 16  # query rows per program at least (Triton's dot wants M >= 16)
# Defaults, chosen for the H200 at D 256 (bf16 cache: 128 words a head row) with 8 warps, so
# that a [rows, D] f32 accumulator, the [rows, keys] scores and the two [keys, words] K/V word
# tiles of a step fit the registers (about 64 words a thread per tile):
BLOCK_ROWS = 64  # query rows (block_q * group) per program: 64 keeps a prefill chunk's grid
# wide enough for the SMs (512 queries, 2 KV heads, group 8: 128 programs)
DECODE_WORDS = 16384  # K tile words per step for a tile of MIN_ROWS rows: decode, 128 keys
BLOCK_WORDS = 8192  # the same for a larger tile (the accumulator takes registers): 64 keys
MAX_KEYS = 128  # keys per step at most by default (smaller head dims)
TARGET_PROGRAMS = 128  # decode's automatic key splits aim at this many programs (132 SMs)
DEFAULT_BLOCKS = TreeAttentionBlocks(num_warps=8, num_stages=1)


def _words_to(w, packed: bool, dtype):
    """``uint32`` words -> the values in ``dtype`` (``packed``: bf16 pairs -> (even, odd)
    columns, each exact in bf16 and f32)."""
    if not packed:
        return (jax.lax.bitcast_convert_type(w, F32),)
    even = jax.lax.bitcast_convert_type(jax.lax.shift_left(w, jnp.uint32(16)), F32)
    odd = jax.lax.bitcast_convert_type(w & jnp.uint32(0xFFFF0000), F32)
    return even.astype(dtype), odd.astype(dtype)


def _iota(shape, dim=0):
    return jax.lax.broadcasted_iota(jnp.int32, shape, dim)


def _kernel(
    len_ref,
    pt_ref,
    tab_ref,
    q_ref,
    ar_ref,
    *refs,
    draft,
    total,
    group,
    block_q,
    rows,
    heads,
    head_dim,
    junk,
    scale,
    fast,
    precision,
    layer,
    kv_offset,
    page_size,
    keys,
    kv_heads,
    packed,
    splits=1,
):
    """One program per (batch row, KV head, query block[, key split]) over ``rows`` stacked
    query rows (module docstring). ``q_ref`` is ``[B, Tq * Hq * D]`` (``[B, Tq, Hq, D]`` flat
    per batch row); ``o_ref`` has ``(rows - block_q * group) * D`` elements more per batch row,
    from ``junk`` on, where the padding rows store. ``draft``: ``refs`` are
    ``(draft_k, draft_v, draft_mask [B, N * N], out)`` and every query sees the committed keys
    ``j < kv_len``, then the draft keys its mask row allows; else ``(q_pos, out)`` and query
    ``t`` sees ``j < min(kv_len, q_pos[t] + 1)``. ``total``: the key count of the XLA path's
    softmax (``MP * S``), for queries that see no key (below). ``fast``: bf16 dot operands
    (module docstring). ``splits > 1`` (no draft): ``refs`` are ``(q_pos, acc, m, l)``, rows
    ``b * splits + split``; the program walks its split's run of the loop steps and stores the
    unnormalised f32 accumulator (laid out as ``out``) and the softmax max ``m`` and sum ``l``
    per query row (one slot per ``D`` elements), which :func:`_combine` merges."""
    if draft:
        dk_ref, dv_ref, mask_ref, o_ref = refs
    elif splits > 1:
        qpos_ref, acc_ref, m_ref, l_ref = refs
    else:
        qpos_ref, o_ref = refs
    b, hk, blk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    parts = 2 if packed else 1
    w = head_dim // parts  # words per head row
    op = BF16 if fast else F32

    # query rows: r = i * group + g (the padding rows repeat the last real one)
    real = block_q * group
    r = _iota((rows,))
    rq = jnp.minimum(r, real - 1)
    t = blk * block_q + jax.lax.div(rq, group)  # [rows]: the row's query index
    first = (t * heads + hk * group + jax.lax.rem(rq, group)) * head_dim  # [rows]
    col = _iota((rows, w), 1) * parts
    qs = [q_ref[b, first[:, None] + col + i].astype(op) for i in range(parts)]
    # a padding row stores into its own spare slot past the [Tq, Hq, D] output (dropped)
    first = jnp.where(r < real, first, junk + (r - real) * head_dim)

    kv_len = len_ref[b]
    if draft:
        limit = hi = kv_len
    else:
        limit = jnp.minimum(qpos_ref[b, t] + 1, kv_len)  # [rows]: keys j < limit are seen
        # causal: the tile's last query bounds the pages, unless a query sees no key (then
        # it averages every committed value, as XLA's uniform softmax does: walk them all)
        hi = jnp.where(jnp.min(limit) > 0, jnp.max(limit), kv_len)
        limit = limit[:, None]

    mpp = pt_ref.shape[0]
    kr = _iota((keys,))  # key row within a step
    token_words = kv_heads * w  # words per token of a K or V block
    k_block = (2 * layer) * page_size * token_words + hk * w
    v_block = page_size * token_words  # the V block follows the K block
    tile_col = _iota((keys, w), 1)
    whole_pages = keys % page_size == 0  # a step covers whole pages (power-of-two pages)
    if whole_pages:
        row_off = kv_offset + k_block + jax.lax.rem(kr, page_size) * token_words  # [keys]

    def address(j):
        """``(segment, first word, handle)`` per key row of step ``j`` (``-1``: unmapped)."""
        if whole_pages:
            page = j * (keys // page_size) + jax.lax.div(kr, page_size)
            off = row_off
        else:  # a step may start and end inside a page
            pos = j * keys + kr
            page = jax.lax.div(pos, page_size)
            off = kv_offset + k_block + jax.lax.rem(pos, page_size) * token_words
        handle = jnp.where(page < mpp, pt_ref[jnp.minimum(page, mpp - 1)], -1)
        h0 = jnp.maximum(handle, 0)
        return tab_ref[h0, 0], tab_ref[h0, 1] + off, handle

    def update(state, s, vs):
        m, l, accs = state
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        pv = p.astype(op)
        accs = tuple(
            alpha[:, None] * a + _dot_nn(pv, v, precision) for a, v in zip(accs, vs, strict=True)
        )
        return m_new, alpha * l + jnp.sum(p, axis=1), accs

    def step(j, carry):
        (seg, base, handle), state = carry
        ahead = address(j + 1)  # independent of this step's loads
        pos = j * keys + kr  # [keys]
        shape = (keys, w)
        live = jnp.broadcast_to(((pos < hi) & (handle >= 0))[:, None], shape)
        segs = jnp.broadcast_to(seg[:, None], shape)
        idx = base[:, None] + tile_col
        k_words = plt.load(ar_ref.at[segs, idx], mask=live, other=jnp.uint32(0))
        v_words = plt.load(ar_ref.at[segs, idx + v_block], mask=live, other=jnp.uint32(0))
        ks, vs = _words_to(k_words, packed, op), _words_to(v_words, packed, op)
        s = sum(_dot_nt(qk, k, precision) for qk, k in zip(qs, ks, strict=True)) * scale
        s = jnp.where(pos[None, :] < limit, s, NEG)
        return ahead, update(state, s, vs)

    state = (
        jnp.full((rows,), NEG, F32),
        jnp.zeros((rows,), F32),
        tuple(jnp.zeros((rows, w), F32) for _ in range(parts)),
    )
    steps = (hi + keys - 1) // keys
    first_step = 0
    if splits > 1:  # this split's contiguous run of the steps (empty past the last step)
        chunk = (steps + splits - 1) // splits
        first_step = jnp.minimum(pl.program_id(3) * chunk, steps)
        steps = jnp.minimum(first_step + chunk, steps)
    _, state = jax.lax.fori_loop(first_step, steps, step, (address(first_step), state))
    if draft:
        cols = [pl.ds(i, w, stride=parts) for i in range(parts)]
        nodes = dk_ref.shape[0]
        s = sum(
            _dot_nt(qk, dk_ref[:, c].astype(op), precision) for qk, c in zip(qs, cols, strict=True)
        )
        seen = mask_ref[b, t[:, None] * nodes + _iota((rows, nodes), 1)] != 0
        s = jnp.where(seen, s * scale, NEG)
        state = update(state, s, tuple(dv_ref[:, c].astype(op) for c in cols))
    m, l, accs = state
    if splits > 1:
        out_row = b * splits + pl.program_id(3)
        slot = jax.lax.div(first, head_dim)  # the query row's (t, head) slot
        m_ref[out_row, slot] = m
        l_ref[out_row, slot] = l
        for i, a in enumerate(accs):
            acc_ref[out_row, first[:, None] + col + i] = a
        return
    if not draft:
        # A query that sees no key (kv_len 0, or q_pos < 0) kept m = NEG, so every walked
        # position had weight exp(0) = 1 and acc = sum_{j < kv_len} v_j. XLA's softmax over
        # ``total`` equal (masked) scores is uniform over all of them, the values past kv_len
        # zeroed: acc / total (0 for a row with kv_len 0).
        l = jnp.where(m == NEG, float(total), l)
    inv = 1.0 / jnp.maximum(l, 1e-30)[:, None]
    for i, a in enumerate(accs):
        o_ref[b, first[:, None] + col + i] = (a * inv).astype(o_ref.dtype)


def _pow2_at_least_1(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1 or value & (value - 1):
        raise ValueError(f"{name}: a power of two >= 1, got {value!r}")


def _prepare(
    q, arena, table, page_handles, hkv, kv_dtype, page_size, queries, block_q, pages_per_step
):
    """Checks the arguments both entry points share and picks the tiles: ``(packed, queries
    per program, rows per program, pages per step, page table padded with -1 to a power of two
    >= pages per step)``. ``queries``: the query (node) count, a block's upper bound.

    Default pages per step: a K tile of ``DECODE_WORDS`` words for a tile of ``MIN_ROWS`` rows
    (decode), ``BLOCK_WORDS`` for more rows, as keys a power of two <= ``MAX_KEYS`` (D 256,
    bf16 cache, S 16: 8 pages, 128 keys, and 4 pages, 64 keys), and at most the page table's
    width rounded up to a power of two."""
    b, _, hq, d = q.shape
    kv_dtype = jnp.dtype(kv_dtype)
    if kv_dtype not in (jnp.dtype(F32), jnp.dtype(BF16)):
        raise ValueError(f"kv_dtype: float32 or bfloat16, got {kv_dtype}")
    if hq % hkv:
        raise ValueError(f"q: heads {hq} must be a multiple of the KV heads {hkv}")
    if arena.ndim != 2 or arena.dtype != jnp.uint32:
        raise ValueError(
            f"arena: expected uint32 [segments, words], got {arena.dtype} {arena.shape}"
        )
    if table.ndim != 2 or table.shape[1] != 2:
        raise ValueError(f"table: expected int [handles, 2], got {table.shape}")
    if page_handles.ndim != 2 or page_handles.shape[0] != b:
        raise ValueError(
            f"page_handles: expected int [B, MP] with B = {b}, got {page_handles.shape}"
        )
    if d < 16 or d & (d - 1):
        raise ValueError(f"D: a power of two >= 16, got {d}")
    if not isinstance(page_size, int | np.integer) or page_size < 16 or page_size % 16:
        raise ValueError(f"page_size: a multiple of 16, got {page_size!r}")
    pow2_pages = not page_size & (page_size - 1)
    if pages_per_step is not None and not pow2_pages:
        raise ValueError(
            f"pages_per_step: only for a power-of-two page_size, got {pages_per_step} with "
            f"page_size {page_size} (its steps are key tiles; leave it None)"
        )
    group = hq // hkv
    if block_q is None:
        block_q = 1 << (max(BLOCK_ROWS // group, 1).bit_length() - 1)
    _pow2_at_least_1("block_q", block_q)
    bq = min(block_q, _next_pow2(queries))
    rows = max(_next_pow2(bq * group), MIN_ROWS)
    mp = page_handles.shape[1]
    packed = kv_dtype == jnp.dtype(BF16)
    words = (DECODE_WORDS if rows <= MIN_ROWS else BLOCK_WORDS) // (d // 2 if packed else d)
    keys = min(1 << (max(words, 1).bit_length() - 1), MAX_KEYS)
    if not pow2_pages:  # key tiles of the default size, at most the keys of the page table
        keys = min(keys, max(_next_pow2(mp * page_size), MIN_ROWS))
        mpp = _next_pow2(mp)
    else:
        if pages_per_step is None:
            pages_per_step = min(max(keys // page_size, 1), _next_pow2(mp))
        _pow2_at_least_1("pages_per_step", pages_per_step)
        keys = page_size * pages_per_step
        mpp = max(_next_pow2(mp), pages_per_step)
    pt = jnp.pad(page_handles.astype(jnp.int32), [(0, 0), (0, mpp - mp)], constant_values=-1)
    return packed, bq, rows, keys, pt


def _attention_call(
    q_p,
    arena,
    table,
    pt,
    kv_len,
    extra,
    extra_specs,
    *,
    hkv,
    bq,
    draft,
    blocks,
    interpret,
    splits=1,
    **kw,
):
    """The ``pallas_call`` on the (batch row, KV head, query block) grid, with a fourth axis of
    ``splits`` key splits when ``splits > 1`` (then :func:`_combine` merges them): ``q_p
    [B, Tq, Hq, D]`` with ``Tq`` a multiple of ``bq`` -> the output in the same shape."""
    b, tq, hq, d = q_p.shape
    size = tq * hq * d  # output elements per batch row, then the padding rows' spare slots
    spare = (kw["rows"] - bq * (hq // hkv)) * d
    kernel = functools.partial(
        _kernel,
        draft=draft,
        group=hq // hkv,
        block_q=bq,
        heads=hq,
        head_dim=d,
        junk=size,
        # bf16 dots want a contraction of >= 16 words (wgmma's K step): D >= 32 packed
        fast=kw["packed"] and q_p.dtype == BF16 and d >= 2 * MIN_ROWS,
        precision=jax.lax.Precision.HIGHEST if q_p.dtype == F32 else None,
        kv_heads=hkv,
        splits=splits,
        **kw,
    )
    whole = pl.BlockSpec(memory_space=None)
    blocks = DEFAULT_BLOCKS if blocks is None else blocks
    call = _call_args(whole, (b, size + spare), q_p.dtype, blocks, interpret)
    grid = (b, hkv, tq // bq)
    if splits > 1:
        grid += (splits,)
        slots = (size + spare) // d
        call.update(
            out_specs=(whole, whole, whole),
            out_shape=(
                jax.ShapeDtypeStruct((b * splits, size + spare), F32),
                jax.ShapeDtypeStruct((b * splits, slots), F32),
                jax.ShapeDtypeStruct((b * splits, slots), F32),
            ),
        )
    out = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            whole,
            pl.BlockSpec((None, pt.shape[1]), lambda i, *_: (i, 0)),
            whole,
            whole,
            whole,
            *extra_specs,
        ],
        **call,
        name="tree_attention_arena" if draft else "paged_attention_arena",
    )(
        kv_len.astype(jnp.int32),
        pt,
        table.astype(jnp.int32),
        q_p.reshape(b, size),
        arena,
        *extra,
    )
    if splits > 1:
        return _combine(*out, splits=splits, shape=q_p.shape, total=kw["total"], dtype=q_p.dtype)
    return (out[:, :size] if spare else out).reshape(b, tq, hq, d)


def _combine(acc, m, l, *, splits, shape, total, dtype):
    """Merges the key splits' partial softmaxes (``acc [B * splits, >= Tq * Hq * D]``, ``m, l
    [B * splits, >= Tq * Hq]`` f32, the padding rows' slots last) into the output ``shape`` in
    ``dtype``: with ``m* = max_s m_s`` and ``w_s = exp(m_s - m*)``, ``sum_s w_s acc_s /
    sum_s w_s l_s``, the kernel's normalisation otherwise (``l = total`` where ``m* = NEG``).

    ``NEG`` is finite, so a split that saw no key (``m_s = NEG``; ``l_s = 0`` and ``acc_s = 0``
    when it walked nothing) gets the weight ``exp(NEG - m*)``: 0 beside a split that saw one,
    1 where no split did; never ``exp(-inf + inf)``. In the latter case ``acc`` sums the
    walked values as in the one-program loop."""
    b, tq, hq, d = shape
    n = tq * hq
    acc = acc.reshape(b, splits, -1)[:, :, : n * d].reshape(b, splits, n, d)
    m, l = (x.reshape(b, splits, -1)[:, :, :n] for x in (m, l))
    m_max = jnp.max(m, axis=1)  # [B, n]
    w = jnp.exp(m - m_max[:, None])
    l = jnp.where(m_max == NEG, float(total), jnp.sum(w * l, axis=1))
    acc = jnp.sum(w[..., None] * acc, axis=1)
    inv = 1.0 / jnp.maximum(l, 1e-30)[..., None]
    return (acc * inv).astype(dtype).reshape(shape)


def _num_splits(num_splits, *, programs: int, query_blocks: int, table_steps: int) -> int:
    """Key splits per (row, KV head, query block): ``num_splits`` checked, or for ``None``
    the automatic choice (module docstring): 1 with several query blocks or at least
    ``TARGET_PROGRAMS`` programs, else ``ceil(TARGET_PROGRAMS / programs)`` capped by the
    page table's loop steps ``table_steps``."""
    if num_splits is None:
        if query_blocks > 1 or programs >= TARGET_PROGRAMS:
            return 1
        return max(min(-(-TARGET_PROGRAMS // programs), table_steps), 1)
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1:
        raise ValueError(f"num_splits: an int >= 1 (or None: automatic), got {num_splits!r}")
    return num_splits


def tree_attention(
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
    blocks: TreeAttentionBlocks | None = None,
    block_q: int | None = None,
    pages_per_step: int | None = None,
    interpret: bool = False,
):
    """:func:`pallas_kernels.attention.kernel` for attention layer ``layer`` with the committed
    K/V in the arena. ``q [B, N, Hq, D]``, ``page_handles int [B, MP]`` (``-1`` = unmapped),
    ``kv_len int [B]``, ``draft_k/v [B, N, Hkv, D]``, ``draft_mask bool [B, N, N]``;
    ``kv_dtype`` is the cache dtype in the units (float32 or bfloat16).

    Knobs (module docstring; ``None`` picks the default): ``block_q`` nodes per program (a
    power of two; default ``BLOCK_ROWS / group`` rounded down to a power of two, at most ``N``
    padded), ``pages_per_step`` pages per loop step (a power of two; default in
    :func:`_prepare`), ``blocks`` Triton warps and stages (default ``DEFAULT_BLOCKS``)."""
    hkv = draft_k.shape[2]
    q_p, dk_p, dv_p, mask, np2 = _pad_nodes(q, draft_k, draft_v, draft_mask)
    packed, bq, rows, keys, pt = _prepare(
        q, arena, table, page_handles, hkv, kv_dtype, page_size, np2, block_q, pages_per_step
    )
    b, n, _, d = q.shape
    kv_spec = pl.BlockSpec((None, np2, None, d), lambda i, h, k: (i, 0, h, 0))
    out = _attention_call(
        q_p,
        arena,
        table,
        pt,
        kv_len,
        (dk_p, dv_p, mask.reshape(b, np2 * np2)),
        (kv_spec, kv_spec, pl.BlockSpec(memory_space=None)),
        hkv=hkv,
        bq=bq,
        draft=True,
        blocks=blocks,
        interpret=interpret,
        packed=packed,
        total=0,
        rows=rows,
        scale=scale,
        layer=layer,
        kv_offset=kv_offset,
        page_size=page_size,
        keys=keys,
    )
    return out[:, :n]


def paged_attention(
    q,
    arena,
    table,
    page_handles,
    kv_len,
    q_pos,
    *,
    layer: int,
    kv_offset: int,
    page_size: int,
    kv_heads: int,
    kv_dtype,
    scale: float,
    block_q: int | None = None,
    blocks: TreeAttentionBlocks | None = None,
    pages_per_step: int | None = None,
    num_splits: int | None = None,
    interpret: bool = False,
):
    """Causal attention of ``q [B, T, Hq, D]`` at positions ``q_pos int [B, T]`` over the
    committed K/V of attention layer ``layer`` in the arena (``page_handles int [B, MP]``,
    ``-1`` = unmapped; ``kv_len int [B]``): query ``t`` sees keys ``j < kv_len[b]`` with
    ``j <= q_pos[b, t]``. Decode is ``T = 1``; prefill writes the chunk's K/V first.

    Same semantics as the XLA path (``gdn_jax.models.tree_attention.attend`` over the
    ``MP * S`` gathered keys, zeroed past ``kv_len``) for a query that sees no key too: the mean
    of the row's committed values over ``MP * S`` (0 for a padding row, ``kv_len`` 0).

    Knobs (module docstring; ``None`` picks the default): ``T`` is split into blocks of
    ``block_q`` queries (a power of two; default ``BLOCK_ROWS / group`` rounded down to a power
    of two, at most ``T`` rounded up to a power of two), one program per (row, KV head, block)
    with ``block_q * group`` query rows, padded to a power of two >= 16 (decode at group 8: 8
    real rows of 16); ``pages_per_step`` pages per loop step (a power of two; default in
    :func:`_prepare`); ``num_splits`` key splits per program's keys (an int >= 1, merged
    after the kernel; default automatic, in :func:`_num_splits`: more than 1 only for a single
    query block on a grid under ``TARGET_PROGRAMS`` programs, decode at small batch); ``blocks``
    Triton warps and stages (default ``DEFAULT_BLOCKS``)."""
    b, t, hq, d = q.shape
    packed, bq, rows, keys, pt = _prepare(
        q, arena, table, page_handles, kv_heads, kv_dtype, page_size, t, block_q, pages_per_step
    )
    if q_pos.shape != (b, t):
        raise ValueError(f"q_pos: expected int [B, T] = {(b, t)}, got {q_pos.shape}")
    tp = -(-t // bq) * bq
    q_p = jnp.pad(q, [(0, 0), (0, tp - t), (0, 0), (0, 0)])
    pos = jnp.pad(q_pos.astype(jnp.int32), [(0, 0), (0, tp - t)], mode="edge")
    splits = _num_splits(
        num_splits,
        programs=b * kv_heads * (tp // bq),
        query_blocks=tp // bq,
        table_steps=-(-page_handles.shape[1] * page_size // keys),
    )
    out = _attention_call(
        q_p,
        arena,
        table,
        pt,
        kv_len,
        (pos,),
        (pl.BlockSpec(memory_space=None),),
        hkv=kv_heads,
        bq=bq,
        draft=False,
        blocks=blocks,
        interpret=interpret,
        splits=splits,
        packed=packed,
        total=page_handles.shape[1] * page_size,
        rows=rows,
        scale=scale,
        layer=layer,
        kv_offset=kv_offset,
        page_size=page_size,
        keys=keys,
    )
    return out[:, :t]
