"""Paged tree attention with the KV pages inside the memory manager's arena, read in place
through the handle table (issue 5): no gather of the pages into a per-layer buffer.

Same math and online softmax as :mod:`pallas_kernels.tree_attention`. A KV unit of the arena is
``[La, 2, S, Hkv, D]`` in the cache dtype (``serving.memory.model_cache.ArenaSpec``), starting
``kv_offset`` words into the unit; row ``b``'s logical page ``j`` is the unit of handle
``page_handles[b, j]``, found at ``table[handle] = (segment, word)``. Each page step loads the
head's ``[S, D]`` K and V tiles as ``uint32`` words with one indexed load each:

- f32 caches: the words are the values (bitcast);
- bf16 caches: a word holds elements ``2i`` (low half) and ``2i + 1`` (high half), and a bf16
  value is the top half of the f32 with the same value, so ``bitcast(w << 16)`` and
  ``bitcast(w & 0xffff0000)`` are the even and odd columns exactly. The kernel never
  interleaves them: ``q k^T = q_even k_even^T + q_odd k_odd^T`` with ``q`` read at stride 2,
  and the output's even and odd columns are accumulated and stored at stride 2.

Positions at or past ``kv_len`` (a recycled page holds arbitrary bits, NaN patterns included)
get a zero value row and a ``-inf`` score, so they contribute nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.tree_attention import (
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


def _words_to_f32(w, packed: bool):
    """``uint32`` words -> the f32 values (``packed``: bf16 pairs -> (even, odd) columns)."""
    if not packed:
        return (jax.lax.bitcast_convert_type(w, F32),)
    even = jax.lax.bitcast_convert_type(jax.lax.shift_left(w, jnp.uint32(16)), F32)
    odd = jax.lax.bitcast_convert_type(w & jnp.uint32(0xFFFF0000), F32)
    return even, odd


def _kernel(
    len_ref, pt_ref, tab_ref, q_ref, ar_ref, dk_ref, dv_ref, mask_ref, o_ref,
    *, group, scale, precision, layer, kv_offset, page_size, kv_heads, packed,
):  # fmt: skip
    b = pl.program_id(0)
    hk = pl.program_id(1) // group
    n, d = q_ref.shape
    parts = 2 if packed else 1
    w = d // parts  # words per head row
    cols = [pl.ds(i, w, stride=parts) for i in range(parts)]  # even/odd (or all) columns
    qs = [q_ref[:, c].astype(F32) * scale for c in cols]
    kv_len = len_ref[b]
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
        accs = tuple(alpha[:, None] * a + _dot_nn(p, v, precision) for a, v in zip(accs, vs, strict=True))
        return m_new, alpha * l + jnp.sum(p, axis=1), accs

    def page_step(j, carry):
        handle = jnp.maximum(pt_ref[j], 0)
        seg = tab_ref[handle, 0]
        base = tab_ref[handle, 1] + kv_offset
        ks = _words_to_f32(ar_ref[seg, base + k_block + tile], packed)
        vs = _words_to_f32(ar_ref[seg, base + v_block + tile], packed)
        live = j * page_size + jax.lax.broadcasted_iota(jnp.int32, (page_size, w), 0) < kv_len
        vs = tuple(jnp.where(live, v, 0.0) for v in vs)
        s = sum(_dot_nt(qk, jnp.where(live, k, 0.0), precision) for k, qk in zip(ks, qs, strict=True))
        pos = j * page_size + jax.lax.broadcasted_iota(jnp.int32, (n, page_size), 1)
        return update(carry, jnp.where(pos < kv_len, s, NEG), vs)

    carry = (
        jnp.full((n,), NEG, F32),
        jnp.zeros((n,), F32),
        tuple(jnp.zeros((n, w), F32) for _ in cols),
    )
    carry = jax.lax.fori_loop(0, (kv_len + page_size - 1) // page_size, page_step, carry)
    s = sum(_dot_nt(qk, dk_ref[:, c].astype(F32), precision) for qk, c in zip(qs, cols, strict=True))
    s = jnp.where(mask_ref[...] != 0, s, NEG)
    m, l, accs = update(carry, s, tuple(dv_ref[:, c].astype(F32) for c in cols))
    inv = 1.0 / jnp.maximum(l, 1e-30)[:, None]
    for c, a in zip(cols, accs, strict=True):
        o_ref[:, c] = (a * inv).astype(o_ref.dtype)


def tree_attention(
    q, arena, table, page_handles, kv_len, draft_k, draft_v, draft_mask, *, layer: int,
    kv_offset: int, page_size: int, kv_dtype, scale: float,
    blocks: TreeAttentionBlocks = DEFAULT_BLOCKS, interpret: bool = False,
):  # fmt: skip
    """:func:`pallas_kernels.tree_attention` for attention layer ``layer`` with the committed
    K/V in the arena. ``q [B, N, Hq, D]``, ``page_handles int [B, MP]`` (``-1`` = unmapped),
    ``kv_len int [B]``, ``draft_k/v [B, N, Hkv, D]``, ``draft_mask bool [B, N, N]``;
    ``kv_dtype`` is the cache dtype in the units (float32 or bfloat16)."""
    b, n, hq, d = q.shape
    hkv = draft_k.shape[2]
    kv_dtype = jnp.dtype(kv_dtype)
    if kv_dtype not in (jnp.dtype(F32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"kv_dtype: float32 or bfloat16, got {kv_dtype}")
    if hq % hkv:
        raise ValueError(f"q: heads {hq} must be a multiple of the KV heads {hkv}")
    if arena.ndim != 2 or arena.dtype != jnp.uint32:
        raise ValueError(f"arena: expected uint32 [segments, words], got {arena.dtype} {arena.shape}")
    if table.ndim != 2 or table.shape[1] != 2:
        raise ValueError(f"table: expected int [handles, 2], got {table.shape}")
    if page_handles.ndim != 2 or page_handles.shape[0] != b:
        raise ValueError(f"page_handles: expected int [B, MP] with B = {b}, got {page_handles.shape}")
    for name, size in (("page_size", page_size), ("D", d)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name}: a power of two >= 16, got {size}")
    packed = kv_dtype == jnp.dtype(jnp.bfloat16)
    q_p, dk_p, dv_p, mask, np2 = _pad_nodes(q, draft_k, draft_v, draft_mask)
    mp2 = _next_pow2(page_handles.shape[1])
    pt = jnp.pad(page_handles.astype(jnp.int32), [(0, 0), (0, mp2 - page_handles.shape[1])],
                 constant_values=-1)  # fmt: skip
    group = hq // hkv
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kernel = functools.partial(
        _kernel, group=group, scale=scale, precision=precision, layer=layer,
        kv_offset=kv_offset, page_size=page_size, kv_heads=hkv, packed=packed)  # fmt: skip
    whole = pl.BlockSpec(memory_space=None)
    q_spec, kv_spec, mask_spec = _node_specs(np2, d, group)
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
