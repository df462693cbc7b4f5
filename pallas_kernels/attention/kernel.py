"""Paged tree attention: draft-tree nodes attend to a paged KV cache plus their path's draft K/V.

Node ``n`` (query ``q [N, D]`` of one head) sees committed keys ``j < kv_len`` read through the
page table (pages ``[P, S, Hkv, D]``), and draft keys ``m`` with ``draft_mask[n, m]`` (the
node's root-to-node path). ``softmax(q k^T * scale) v`` over both, by an online (flash-style)
softmax in f32: one program per (batch row, query head) walks the row's pages with a
``fori_loop`` bounded by ``cdiv(kv_len, S)``, then folds in the ``N`` draft keys. The XLA
reference is ``gdn_jax.models.tree_attention.paged_attention`` (tests compare against it).

Triton-lowering constraints are met by padding ``N`` and the page-table width to powers of two;
``S`` and ``D`` must be powers of two (>= 16 on the GPU).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

NEG = -1e30


@dataclasses.dataclass(frozen=True)
class TreeAttentionBlocks:
    """Static knobs: Triton warps / stages."""

    num_warps: int = 4
    num_stages: int = 1


def _next_pow2(x: int) -> int:
    return 1 << max(x - 1, 0).bit_length()


def _pad_nodes(q, draft_k, draft_v, draft_mask):
    """Pads the node axis to a power of two of at least 16 (Triton's dots want M, N >= 16):
    ``(q, draft_k, draft_v, mask int32, N padded)``; padded nodes see themselves, so no row of
    the softmax is empty."""
    n = q.shape[1]
    np2 = max(_next_pow2(n), 16)
    pad_n = lambda x: jnp.pad(x, [(0, 0), (0, np2 - n)] + [(0, 0)] * (x.ndim - 2))
    mask = jnp.pad(draft_mask, [(0, 0), (0, np2 - n), (0, np2 - n)])
    mask = (mask | (jnp.arange(np2) >= n)[:, None] & jnp.eye(np2, dtype=bool)).astype(jnp.int32)
    return pad_n(q), pad_n(draft_k), pad_n(draft_v), mask, np2


def _node_specs(np2: int, d: int, group: int):
    """Block specs on the (batch row, query head) grid: ``(q and output, draft K/V, mask)``."""
    return (
        pl.BlockSpec((None, np2, None, d), lambda i, h: (i, 0, h, 0)),
        pl.BlockSpec((None, np2, None, d), lambda i, h: (i, 0, h // group, 0)),
        pl.BlockSpec((None, np2, np2), lambda i, h: (i, 0, 0)),
    )


def _call_args(q_spec, shape, dtype, blocks: TreeAttentionBlocks, interpret: bool) -> dict:
    """The ``pallas_call`` arguments both attention kernels share (output, launch knobs)."""
    return dict(
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(shape, dtype),
        compiler_params=plt.CompilerParams(
            num_warps=blocks.num_warps, num_stages=blocks.num_stages
        ),
        interpret=interpret,
    )


def _dot_nt(a, b, precision):
    return jax.lax.dot_general(
        a, b, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


def _dot_nn(a, b, precision):
    return jax.lax.dot_general(
        a, b, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


def _kernel(
    len_ref,
    pt_ref,
    q_ref,
    kp_ref,
    vp_ref,
    dk_ref,
    dv_ref,
    mask_ref,
    o_ref,
    *,
    group,
    scale,
    precision,
):
    b = pl.program_id(0)
    hk = pl.program_id(1) // group
    q = q_ref[...].astype(jnp.float32) * scale  # [N, D]
    n, d = q.shape
    s_page = kp_ref.shape[1]
    kv_len = len_ref[b]

    def update(carry, s, v):
        m, l, acc = carry
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        return (
            m_new,
            alpha * l + jnp.sum(p, axis=1),
            alpha[:, None] * acc + _dot_nn(p, v.astype(jnp.float32), precision),
        )

    def page_step(j, carry):
        page = pt_ref[j]
        k = kp_ref[page, :, hk, :].astype(jnp.float32)  # [S, D]
        v = vp_ref[page, :, hk, :]
        pos = j * s_page + jax.lax.broadcasted_iota(jnp.int32, (n, s_page), 1)
        s = jnp.where(pos < kv_len, _dot_nt(q, k, precision), NEG)
        return update(carry, s, v)

    carry = (
        jnp.full((n,), NEG, jnp.float32),
        jnp.zeros((n,), jnp.float32),
        jnp.zeros((n, d), jnp.float32),
    )
    carry = jax.lax.fori_loop(0, (kv_len + s_page - 1) // s_page, page_step, carry)
    s = _dot_nt(q, dk_ref[...].astype(jnp.float32), precision)  # [N, N]
    s = jnp.where(mask_ref[...] != 0, s, NEG)
    m, l, acc = update(carry, s, dv_ref[...])
    o_ref[...] = (acc / jnp.maximum(l, 1e-30)[:, None]).astype(o_ref.dtype)


def tree_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    kv_len: jax.Array,
    draft_k: jax.Array,
    draft_v: jax.Array,
    draft_mask: jax.Array,
    *,
    scale: float,
    blocks: TreeAttentionBlocks = TreeAttentionBlocks(),
    interpret: bool = False,
) -> jax.Array:
    """``q [B, N, Hq, D]``, pages ``[P, S, Hkv, D]``, ``page_table int [B, MP]``,
    ``kv_len int [B]``, ``draft_k/v [B, N, Hkv, D]``, ``draft_mask bool [B, N, N]`` ->
    ``[B, N, Hq, D]`` in q's dtype."""
    b, n, hq, d = q.shape
    hkv = k_pages.shape[2]
    if hq % hkv:
        raise ValueError(f"q: heads {hq} must be a multiple of the KV heads {hkv}")
    q_p, dk_p, dv_p, mask, np2 = _pad_nodes(q, draft_k, draft_v, draft_mask)
    mp2 = _next_pow2(page_table.shape[1])
    pt = jnp.pad(page_table.astype(jnp.int32), [(0, 0), (0, mp2 - page_table.shape[1])])
    pt = jnp.clip(pt, 0, k_pages.shape[0] - 1)
    group = hq // hkv
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kernel = functools.partial(_kernel, group=group, scale=scale, precision=precision)
    q_spec, kv_spec, mask_spec = _node_specs(np2, d, group)
    full = lambda x: pl.BlockSpec(x.shape, lambda i, h: (0,) * x.ndim)
    out = pl.pallas_call(
        kernel,
        grid=(b, hq),
        in_specs=[
            full(kv_len),
            pl.BlockSpec((None, mp2), lambda i, h: (i, 0)),
            q_spec,
            full(k_pages),
            full(v_pages),
            kv_spec,
            kv_spec,
            mask_spec,
        ],
        **_call_args(q_spec, (b, np2, hq, d), q.dtype, blocks, interpret),
    )(kv_len.astype(jnp.int32), pt, q_p, k_pages, v_pages, dk_p, dv_p, mask)
    return out[:, :n]
