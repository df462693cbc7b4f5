"""Attention over a paged KV cache plus optional draft K/V: the XLA reference.

KV pages: ``k_pages, v_pages: [P, S, Hkv, D]`` (one pool per attention layer), ``page_table:
int32 [B, MP]`` maps row ``b``'s logical page ``j // S`` to a physical page (entries past the
row's length are ignored). A query at position ``p`` of row ``b`` sees

- committed keys ``j < kv_len[b]`` with ``j <= p`` (causal; prefill writes its own K/V first);
- draft keys ``m`` with ``draft_mask[b, t, m]`` (a tree node sees the draft K/V of its path).

Scores in f32, ``softmax(q k^T * scale)`` over both sets together; GQA without repeating K/V.
The Pallas kernel in ``pallas_kernels/attention/kernel.py`` computes the same thing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from gdn_jax.models.linear import matmul_precision

NEG = -1e30  # finite: a row with no visible key gives a finite (unused) output, never NaN


def gather_pages(pages: jax.Array, page_table: jax.Array) -> jax.Array:
    """``[P, S, ...]`` pages seen through ``page_table [B, MP]`` as ``[B, MP * S, ...]``."""
    p = pages.shape[0]
    g = pages[jnp.clip(page_table, 0, p - 1)]  # [B, MP, S, ...]
    return g.reshape(g.shape[0], -1, *g.shape[3:])


def write_pages(
    pages: jax.Array,
    page_table: jax.Array,
    positions: jax.Array,
    values: jax.Array,
    valid: jax.Array,
) -> jax.Array:
    """Writes ``values [B, T, ...]`` at token positions ``[B, T]`` where ``valid``.

    Entries that are not valid, or whose logical page is past the table or unmapped (< 0), are
    dropped.
    """
    p, s = pages.shape[:2]
    mp = page_table.shape[1]
    logical = positions // s
    page = jnp.take_along_axis(page_table, jnp.clip(logical, 0, mp - 1), axis=1)
    ok = valid & (logical < mp) & (page >= 0)
    page = jnp.where(ok, page, p)  # out of bounds: dropped by the scatter
    return pages.at[page, positions % s].set(values.astype(pages.dtype), mode="drop")


def attend(
    q: Float[Array, "B T Hq D"],
    k: Float[Array, "B M Hkv D"],
    v: Float[Array, "B M Hkv D"],
    mask: Bool[Array, "B T M"],
    scale: float,
) -> Float[Array, "B T Hq D"]:
    """Masked softmax attention with grouped KV heads (``Hq = G * Hkv``)."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    prec = matmul_precision(q.dtype)
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    s = (
        jnp.einsum(
            "btkgd,bmkd->bkgtm",
            qg,
            k.astype(q.dtype),
            precision=prec,
            preferred_element_type=jnp.float32,
        )
        * scale
    )
    s = jnp.where(mask[:, None, None], s, NEG)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    o = jnp.einsum("bkgtm,bmkd->btkgd", p, v, precision=prec)
    return o.reshape(b, t, hq, d).astype(q.dtype)


def paged_attention(
    q: Float[Array, "B T Hq D"],
    k_pages: Float[Array, "P S Hkv D"],
    v_pages: Float[Array, "P S Hkv D"],
    page_table: Int[Array, "B MP"],
    kv_len: Int[Array, " B"],
    q_pos: Int[Array, "B T"],
    *,
    scale: float,
    draft_k: Float[Array, "B N Hkv D"] | None = None,
    draft_v: Float[Array, "B N Hkv D"] | None = None,
    draft_mask: Bool[Array, "B T N"] | None = None,
) -> Float[Array, "B T Hq D"]:
    """Attention of ``q`` over the committed paged KV and the optional draft K/V (module doc)."""
    k = gather_pages(k_pages, page_table)
    v = gather_pages(v_pages, page_table)
    return attend_committed(
        q, k, v, kv_len, q_pos, scale=scale, draft_k=draft_k, draft_v=draft_v, draft_mask=draft_mask
    )


def attend_committed(
    q: Float[Array, "B T Hq D"],
    k: Float[Array, "B L Hkv D"],
    v: Float[Array, "B L Hkv D"],
    kv_len: Int[Array, " B"],
    q_pos: Int[Array, "B T"],
    *,
    scale: float,
    draft_k: Float[Array, "B N Hkv D"] | None = None,
    draft_v: Float[Array, "B N Hkv D"] | None = None,
    draft_mask: Bool[Array, "B T N"] | None = None,
) -> Float[Array, "B T Hq D"]:
    """Attention of ``q`` over committed keys ``j < kv_len[b]`` with ``j <= q_pos[b, t]`` of
    ``k, v`` (the row's pages already gathered), then the draft K/V where ``draft_mask``."""
    j = jnp.arange(k.shape[1])
    mask = (j[None, None, :] < kv_len[:, None, None]) & (j[None, None, :] <= q_pos[:, :, None])
    if draft_k is not None:
        k = jnp.concatenate([k, draft_k.astype(k.dtype)], axis=1)
        v = jnp.concatenate([v, draft_v.astype(v.dtype)], axis=1)
        mask = jnp.concatenate([mask, draft_mask], axis=2)
    return attend(q, k, v, mask, scale)
