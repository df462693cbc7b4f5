"""Plain-JAX reference of paged attention: the specification of ``kernel.py`` and ``arena.py``.

Row ``b``'s committed keys and values are its pages gathered in page-table order, ``K, V
[MP * S, Hkv, D]`` (page ``j // S``, slot ``j % S``), zeroed at positions ``j >= kv_len[b]``.
Query head ``h`` reads KV head ``h // (Hq // Hkv)``; each query attends to the keys it sees::

    o = softmax_j(scale * q . k_j over the seen j) v

in f32, the output in q's dtype.

- tree attention (draft-tree verify): node ``n`` sees the committed keys ``j < kv_len[b]``
  and the draft keys ``m`` with ``draft_mask[b, n, m]`` (its root-to-node path);
- causal paged attention (decode, prefill): query ``t`` sees the committed keys
  ``j < kv_len[b]`` with ``j <= q_pos[b, t]``; a query that sees no key gets the uniform
  softmax over all ``MP * S`` positions (the mean of the zeroed values, 0 when ``kv_len`` is 0).

The arena forms first read the pages out of the serving memory arena: row ``b``'s page ``j`` is
the KV unit ``[La, 2, S, Hkv, D]`` (cache dtype, f32 or bf16 packed two to a ``uint32`` word,
element ``2i`` in the low half) of handle ``page_handles[b, j]``, ``kv_offset`` words after
``table[handle] = (segment, word)``; an unmapped page (handle ``< 0``) reads as zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._reference import F32, HIGHEST, value_heads

MASKED = -1e30  # finite: a query that sees no key gets a uniform softmax, not NaN


def _attend(q, k, v, seen, scale):
    """``q [B, T, Hq, D]``, ``k, v [B, L, Hkv, D]``, ``seen bool [B, T, L]`` -> f32 ``[B, T,
    Hq, D]``: the softmax over the seen keys (uniform over all ``L`` for a query that sees
    none)."""
    hq = q.shape[2]
    k, v = (value_heads(x.astype(F32), hq, axis=2) for x in (k, v))
    s = jnp.einsum("bthd,blhd->bhtl", q.astype(F32), k, precision=HIGHEST) * scale
    p = jax.nn.softmax(jnp.where(seen[:, None], s, MASKED), axis=-1)
    return jnp.einsum("bhtl,blhd->bthd", p, v, precision=HIGHEST)


def _committed(k_pages, v_pages, page_table, kv_len):
    """Row-wise committed ``K, V [B, MP * S, Hkv, D]`` (zeros at ``j >= kv_len``) and the
    ``[B, MP * S]`` mask ``j < kv_len``."""
    b, mp = page_table.shape
    s = k_pages.shape[1]
    live = jnp.arange(mp * s)[None, :] < kv_len[:, None]

    def gather(pages):
        rows = jnp.take(pages, page_table, axis=0, mode="clip")  # [B, MP, S, Hkv, D]
        rows = rows.reshape(b, mp * s, *pages.shape[2:]).astype(F32)
        return jnp.where(live[:, :, None, None], rows, 0.0)

    return gather(k_pages), gather(v_pages), live


@functools.partial(jax.jit, static_argnames=("scale",))
def paged_tree_attention_reference(
    q, k_pages, v_pages, page_table, kv_len, draft_k, draft_v, draft_mask, *, scale
):
    """Tree attention (module docstring). ``q [B, N, Hq, D]``, pages ``[P, S, Hkv, D]``,
    ``page_table int [B, MP]``, ``kv_len int [B]``, ``draft_k/v [B, N, Hkv, D]``,
    ``draft_mask bool [B, N, N]`` -> ``[B, N, Hq, D]`` in q's dtype, as
    :func:`pallas_kernels.attention.tree_attention`."""
    k, v, live = _committed(k_pages, v_pages, page_table, kv_len)
    n = q.shape[1]
    seen = jnp.concatenate(
        [jnp.broadcast_to(live[:, None], (live.shape[0], n, live.shape[1])), draft_mask], -1
    )
    keys = jnp.concatenate([k, draft_k.astype(F32)], 1)
    values = jnp.concatenate([v, draft_v.astype(F32)], 1)
    return _attend(q, keys, values, seen, scale).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("scale",))
def paged_attention_reference(q, k_pages, v_pages, page_table, kv_len, q_pos, *, scale):
    """Causal paged attention (module docstring). ``q [B, T, Hq, D]`` at positions
    ``q_pos int [B, T]``, pages ``[P, S, Hkv, D]``, ``page_table int [B, MP]``, ``kv_len
    int [B]`` -> ``[B, T, Hq, D]`` in q's dtype."""
    k, v, live = _committed(k_pages, v_pages, page_table, kv_len)
    causal = jnp.arange(k.shape[1])[None, None, :] <= q_pos[:, :, None]
    return _attend(q, k, v, live[:, None, :] & causal, scale).astype(q.dtype)


def _arena_pages(arena, table, page_handles, shape, layer, kv_offset, page_size, kv_dtype):
    """Attention layer ``layer``'s pages out of the arena (module docstring), ``shape = (Hkv,
    D)``: ``(k_pages, v_pages [B * MP, S, Hkv, D] in kv_dtype, page_table int [B, MP])`` in the
    dense form (row ``b``'s page ``j`` is page ``b * MP + j``; zeros for an unmapped one)."""
    kv_dtype = jnp.dtype(kv_dtype)
    layer_words = 2 * page_size * shape[0] * shape[1] * kv_dtype.itemsize // 4

    def page(handle):
        seg, word = table[jnp.maximum(handle, 0)]
        start = word + kv_offset + layer * layer_words
        words = jax.lax.dynamic_slice(arena[seg], (start,), (layer_words,))
        kv = jax.lax.bitcast_convert_type(words, kv_dtype).reshape(2, page_size, *shape)
        return jnp.where(handle >= 0, kv, jnp.zeros_like(kv))

    kv = jax.vmap(page)(page_handles.reshape(-1))
    b, mp = page_handles.shape
    return kv[:, 0], kv[:, 1], jnp.arange(b * mp, dtype=jnp.int32).reshape(b, mp)


_ARENA_STATIC = ("layer", "kv_offset", "page_size", "kv_dtype", "scale")


@functools.partial(jax.jit, static_argnames=_ARENA_STATIC)
def tree_attention_arena_reference(
    q,
    arena,
    table,
    page_handles,
    kv_len,
    draft_k,
    draft_v,
    draft_mask,
    *,
    layer,
    kv_offset,
    page_size,
    kv_dtype,
    scale,
):
    """:func:`paged_tree_attention_reference` over the pages of attention layer ``layer`` in
    the arena (module docstring), as :func:`pallas_kernels.attention.arena.tree_attention`."""
    where = (layer, kv_offset, page_size, kv_dtype)
    pages = _arena_pages(arena, table, page_handles, draft_k.shape[2:], *where)
    return paged_tree_attention_reference(
        q, *pages, kv_len, draft_k, draft_v, draft_mask, scale=scale
    )


@functools.partial(jax.jit, static_argnames=(*_ARENA_STATIC, "kv_heads"))
def paged_attention_arena_reference(
    q,
    arena,
    table,
    page_handles,
    kv_len,
    q_pos,
    *,
    layer,
    kv_offset,
    page_size,
    kv_heads,
    kv_dtype,
    scale,
):
    """:func:`paged_attention_reference` over the pages of attention layer ``layer`` in the
    arena (module docstring), as :func:`pallas_kernels.attention.arena.paged_attention`."""
    where = (layer, kv_offset, page_size, kv_dtype)
    pages = _arena_pages(arena, table, page_handles, (kv_heads, q.shape[3]), *where)
    return paged_attention_reference(q, *pages, kv_len, q_pos, scale=scale)
