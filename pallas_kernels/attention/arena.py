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
``table[handle] = (segment, word)``. Each page step loads the head's ``[S, D]`` K and V tiles as
``uint32`` words with one indexed load each:

- f32 caches: the words are the values (bitcast);
- bf16 caches: a word holds elements ``2i`` (low half) and ``2i + 1`` (high half), and a bf16
  value is the top half of the f32 with the same value, so ``bitcast(w << 16)`` and
  ``bitcast(w & 0xffff0000)`` are the even and odd columns exactly. The kernel never
  interleaves them: ``q k^T = q_even k_even^T + q_odd k_odd^T`` with ``q`` read at stride 2,
  and the output's even and odd columns are accumulated and stored at stride 2.

Positions at or past ``kv_len`` (a recycled page holds arbitrary bits, NaN patterns included)
get a zero value row and a ``-inf`` score, so they contribute nothing; an unmapped page
(handle ``-1``) below ``kv_len`` reads as zeros, as the XLA path's gather reads it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.attention.kernel import (
    NEG,
    TreeAttentionBlocks,
    _call_args,
    _dot_nn,
    _dot_nt,
    _next_pow2,
    _node_specs,
    _pad_nodes,
)

F32 = jnp.float32
DEFAULT_BLOCKS = TreeAttentionBlocks()
BLOCK_Q = 64  # queries per program of paged_attention (a longer prefill chunk: more programs)
MIN_ROWS = 16  # query rows per program at least (Triton's dot wants M >= 16; decode pads 1 -> 16)


def _words_to_f32(w, packed: bool):
    """``uint32`` words -> the f32 values (``packed``: bf16 pairs -> (even, odd) columns)."""
    if not packed:
        return (jax.lax.bitcast_convert_type(w, F32),)
    even = jax.lax.bitcast_convert_type(jax.lax.shift_left(w, jnp.uint32(16)), F32)
    odd = jax.lax.bitcast_convert_type(w & jnp.uint32(0xFFFF0000), F32)
    return even, odd


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
    scale,
    precision,
    layer,
    kv_offset,
    page_size,
    kv_heads,
    packed,
):
    """One program per (batch row, query head[, query block]). ``draft``: ``refs`` are
    ``(draft_k, draft_v, draft_mask, out)`` and every query sees the committed keys
    ``j < kv_len``, then the draft keys its mask row allows; else ``(q_pos, out)`` and query
    ``t`` sees ``j < min(kv_len, q_pos[t] + 1)``. ``total``: the key count of the XLA path's
    softmax (``MP * S``), for queries that see no key (below)."""
    if draft:
        dk_ref, dv_ref, mask_ref, o_ref = refs
    else:
        qpos_ref, o_ref = refs
    b = pl.program_id(0)
    hk = pl.program_id(1) // group
    n, d = q_ref.shape
    parts = 2 if packed else 1
    w = d // parts  # words per head row
    cols = [pl.ds(i, w, stride=parts) for i in range(parts)]  # even/odd (or all) columns
    qs = [q_ref[:, c].astype(F32) * scale for c in cols]
    kv_len = len_ref[b]
    if draft:
        limit = hi = kv_len
    else:
        limit = jnp.minimum(qpos_ref[...] + 1, kv_len)  # [n]: keys j < limit are seen
        # causal: the block's last query bounds the pages, unless a query sees no key (then
        # it averages every committed value, as XLA's uniform softmax does: walk them all)
        hi = jnp.where(jnp.min(limit) > 0, jnp.max(limit), kv_len)
        limit = limit[:, None]
    row = jax.lax.broadcasted_iota(jnp.int32, (page_size, w), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (page_size, w), 1)
    tile = row * (kv_heads * w) + col  # word index of (token, column) within a K or V block
    k_block = (2 * layer) * page_size * kv_heads * w + hk * w
    v_block = k_block + page_size * kv_heads * w

    def update(carry, s, vs):
        m, l, accs = carry
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        accs = tuple(
            alpha[:, None] * a + _dot_nn(p, v, precision) for a, v in zip(accs, vs, strict=True)
        )
        return m_new, alpha * l + jnp.sum(p, axis=1), accs

    def page_step(j, carry):
        handle = pt_ref[j]
        seg = tab_ref[jnp.maximum(handle, 0), 0]
        base = tab_ref[jnp.maximum(handle, 0), 1] + kv_offset
        ks = _words_to_f32(ar_ref[seg, base + k_block + tile], packed)
        vs = _words_to_f32(ar_ref[seg, base + v_block + tile], packed)
        # an unmapped page reads as zeros (as XLA's gather of it), a position past kv_len too
        live = (j * page_size + row < kv_len) & (handle >= 0)
        vs = tuple(jnp.where(live, v, 0.0) for v in vs)
        s = sum(
            _dot_nt(qk, jnp.where(live, k, 0.0), precision) for k, qk in zip(ks, qs, strict=True)
        )
        pos = j * page_size + jax.lax.broadcasted_iota(jnp.int32, (n, page_size), 1)
        return update(carry, jnp.where(pos < limit, s, NEG), vs)

    carry = (
        jnp.full((n,), NEG, F32),
        jnp.zeros((n,), F32),
        tuple(jnp.zeros((n, w), F32) for _ in cols),
    )
    carry = jax.lax.fori_loop(0, (hi + page_size - 1) // page_size, page_step, carry)
    if draft:
        s = sum(
            _dot_nt(qk, dk_ref[:, c].astype(F32), precision) for qk, c in zip(qs, cols, strict=True)
        )
        s = jnp.where(mask_ref[...] != 0, s, NEG)
        carry = update(carry, s, tuple(dv_ref[:, c].astype(F32) for c in cols))
    m, l, accs = carry
    if not draft:
        # A query that sees no key (kv_len 0, or q_pos < 0) kept m = NEG, so every walked
        # position had weight exp(0) = 1 and acc = sum_{j < kv_len} v_j. XLA's softmax over
        # ``total`` equal (masked) scores is uniform over all of them, the values past kv_len
        # zeroed: acc / total (0 for a row with kv_len 0).
        l = jnp.where(m == NEG, float(total), l)
    inv = 1.0 / jnp.maximum(l, 1e-30)[:, None]
    for c, a in zip(cols, accs, strict=True):
        o_ref[:, c] = (a * inv).astype(o_ref.dtype)


def _prepare(q, arena, table, page_handles, hkv, kv_dtype, page_size):
    """Checks the arguments both entry points share: ``(packed, page table padded to a power
    of two with -1, its width)``."""
    b, _, hq, d = q.shape
    kv_dtype = jnp.dtype(kv_dtype)
    if kv_dtype not in (jnp.dtype(F32), jnp.dtype(jnp.bfloat16)):
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
    for name, size in (("page_size", page_size), ("D", d)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name}: a power of two >= 16, got {size}")
    mp2 = _next_pow2(page_handles.shape[1])
    pt = jnp.pad(
        page_handles.astype(jnp.int32),
        [(0, 0), (0, mp2 - page_handles.shape[1])],
        constant_values=-1,
    )
    return kv_dtype == jnp.dtype(jnp.bfloat16), pt, mp2


def _body(q, hkv, packed, draft, total, **static):
    """The kernel with its static arguments bound."""
    hq = q.shape[2]
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    return functools.partial(
        _kernel,
        draft=draft,
        total=total,
        group=hq // hkv,
        precision=precision,
        kv_heads=hkv,
        packed=packed,
        **static,
    )


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
    blocks: TreeAttentionBlocks = DEFAULT_BLOCKS,
    interpret: bool = False,
):
    """:func:`pallas_kernels.attention.kernel` for attention layer ``layer`` with the committed
    K/V in the arena. ``q [B, N, Hq, D]``, ``page_handles int [B, MP]`` (``-1`` = unmapped),
    ``kv_len int [B]``, ``draft_k/v [B, N, Hkv, D]``, ``draft_mask bool [B, N, N]``;
    ``kv_dtype`` is the cache dtype in the units (float32 or bfloat16)."""
    b, n, hq, d = q.shape
    hkv = draft_k.shape[2]
    packed, pt, mp2 = _prepare(q, arena, table, page_handles, hkv, kv_dtype, page_size)
    q_p, dk_p, dv_p, mask, np2 = _pad_nodes(q, draft_k, draft_v, draft_mask)
    static = dict(scale=scale, layer=layer, kv_offset=kv_offset, page_size=page_size)
    kernel = _body(q, hkv, packed, True, 0, **static)
    whole = pl.BlockSpec(memory_space=None)
    q_spec, kv_spec, mask_spec = _node_specs(np2, d, hq // hkv)
    out = pl.pallas_call(
        kernel,
        grid=(b, hq),
        in_specs=[
            whole,
            pl.BlockSpec((None, mp2), lambda i, h: (i, 0)),
            whole,
            q_spec,
            whole,
            kv_spec,
            kv_spec,
            mask_spec,
        ],
        **_call_args(q_spec, (b, np2, hq, d), q.dtype, blocks, interpret),
        name="tree_attention_arena",
    )(kv_len.astype(jnp.int32), pt, table.astype(jnp.int32), q_p, arena, dk_p, dv_p, mask)
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
    block_q: int = BLOCK_Q,
    blocks: TreeAttentionBlocks = DEFAULT_BLOCKS,
    interpret: bool = False,
):
    """Causal attention of ``q [B, T, Hq, D]`` at positions ``q_pos int [B, T]`` over the
    committed K/V of attention layer ``layer`` in the arena (``page_handles int [B, MP]``,
    ``-1`` = unmapped; ``kv_len int [B]``): query ``t`` sees keys ``j < kv_len[b]`` with
    ``j <= q_pos[b, t]``. Decode is ``T = 1``; prefill writes the chunk's K/V first.

    Same semantics as the XLA path (``gdn_jax.models.tree_attention.attend`` over the
    ``MP * S`` gathered keys, zeroed past ``kv_len``) for a query that sees no key too: the mean
    of the row's committed values over ``MP * S`` (0 for a padding row, ``kv_len`` 0).
    ``T`` is split into blocks of ``block_q`` (a power of two >= 16) queries, one program
    each; a shorter ``T`` is padded to a power of two >= 16 (decode: 1 -> 16 rows)."""
    b, t, hq, d = q.shape
    packed, pt, mp2 = _prepare(q, arena, table, page_handles, kv_heads, kv_dtype, page_size)
    if q_pos.shape != (b, t):
        raise ValueError(f"q_pos: expected int [B, T] = {(b, t)}, got {q_pos.shape}")
    if block_q < MIN_ROWS or block_q & (block_q - 1):
        raise ValueError(f"block_q: a power of two >= {MIN_ROWS}, got {block_q}")
    bq = max(min(_next_pow2(t), block_q), MIN_ROWS)
    tp = -(-t // bq) * bq
    q_p = jnp.pad(q, [(0, 0), (0, tp - t), (0, 0), (0, 0)])
    pos = jnp.pad(q_pos.astype(jnp.int32), [(0, 0), (0, tp - t)], mode="edge")
    static = dict(scale=scale, layer=layer, kv_offset=kv_offset, page_size=page_size)
    kernel = _body(q, kv_heads, packed, False, page_handles.shape[1] * page_size, **static)
    whole = pl.BlockSpec(memory_space=None)
    q_spec = pl.BlockSpec((None, bq, None, d), lambda i, h, k: (i, k, h, 0))
    out = pl.pallas_call(
        kernel,
        grid=(b, hq, tp // bq),
        in_specs=[
            whole,
            pl.BlockSpec((None, mp2), lambda i, h, k: (i, 0)),
            whole,
            q_spec,
            whole,
            pl.BlockSpec((None, bq), lambda i, h, k: (i, k)),
        ],
        **_call_args(q_spec, (b, tp, hq, d), q.dtype, blocks, interpret),
        name="paged_attention_arena",
    )(kv_len.astype(jnp.int32), pt, table.astype(jnp.int32), q_p, arena, pos)
    return out[:, :t]
