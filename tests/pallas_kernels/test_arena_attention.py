"""Paged tree attention reading K/V pages inside a uint32 arena through the handle table
(pallas_kernels.arena_attention, interpret mode) against the dense-pages kernel."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.arena_attention import tree_attention as arena_attention
from pallas_kernels.tree_attention import tree_attention as dense_attention

B, N, HQ, HKV, D, S, LAYERS, LAYER, OFFSET = 2, 5, 4, 2, 16, 16, 2, 1, 10


def _setup(dtype, seed=0):
    rng = np.random.default_rng(seed)
    lens = np.array([37, 16])  # row 0 ends inside its third page; row 1 fills one page exactly
    per_word = 1 if dtype == np.float32 else 2
    unit_words = LAYERS * 2 * S * HKV * D // per_word
    arena = rng.integers(0, 2**32, (4, 8192), dtype=np.uint32)  # garbage, NaN patterns too
    table = np.array([[0, 0], [1, 100], [2, 3000], [3, 50], [0, 4000], [1, 5000]], np.int32)
    handles = np.array([[3, 0, 5], [1, -1, -1]], np.int32)  # -1: unmapped
    k_pages = np.zeros((B * 3, S, HKV, D), np.float32)
    v_pages = np.zeros_like(k_pages)
    for r in range(B):
        for j in range(3):
            if handles[r, j] < 0:
                continue
            unit = jnp.asarray(rng.standard_normal((LAYERS, 2, S, HKV, D)), dtype)
            live = ((j * S + np.arange(S)) < lens[r])[:, None, None]
            k_pages[r * 3 + j] = np.asarray(unit[LAYER, 0].astype(jnp.float32)) * live
            v_pages[r * 3 + j] = np.asarray(unit[LAYER, 1].astype(jnp.float32)) * live
            seg, word = table[handles[r, j]]
            words = np.asarray(unit).reshape(-1).view(np.uint32)
            arena[seg, word + OFFSET : word + OFFSET + unit_words] = words
    dense_table = np.arange(B * 3, dtype=np.int32).reshape(B, 3)
    cast = lambda x: jnp.asarray(x, dtype)
    q = cast(rng.standard_normal((B, N, HQ, D)))
    dk, dv = (cast(rng.standard_normal((B, N, HKV, D))) for _ in range(2))
    mask = jnp.asarray(np.broadcast_to(np.tril(np.ones((N, N), bool)), (B, N, N)))
    dense = (cast(k_pages), cast(v_pages), jnp.asarray(dense_table))
    return q, dk, dv, mask, lens, (arena, table, handles), dense


@pytest.mark.parametrize("dtype, tol", [(np.float32, 1e-6), (jnp.bfloat16, 1e-2)])
def test_arena_attention_matches_dense_pages(dtype, tol):
    q, dk, dv, mask, lens, (arena, table, handles), (kp, vp, pt) = _setup(dtype)
    want = dense_attention(q, kp, vp, pt, jnp.asarray(lens), dk, dv, mask, scale=0.25,
                           interpret=True)  # fmt: skip
    got = arena_attention(
        q, jnp.asarray(arena), jnp.asarray(table), jnp.asarray(handles), jnp.asarray(lens),
        dk, dv, mask, layer=LAYER, kv_offset=OFFSET, page_size=S, kv_dtype=dtype, scale=0.25,
        interpret=True,
    )  # fmt: skip
    assert got.shape == want.shape and got.dtype == want.dtype
    got, want = np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32))
    assert np.all(np.isfinite(got))  # garbage past kv_len never leaks in
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def test_arena_attention_bad_inputs_raise():
    q, dk, dv, mask, lens, (arena, table, handles), _ = _setup(np.float32)
    kw = dict(layer=LAYER, kv_offset=OFFSET, page_size=S, scale=0.25, interpret=True)
    a, t, h, l = (jnp.asarray(x) for x in (arena, table, handles, lens))
    with pytest.raises(ValueError, match="kv_dtype"):
        arena_attention(q, a, t, h, l, dk, dv, mask, kv_dtype=jnp.int8, **kw)
    with pytest.raises(ValueError, match="arena:"):
        arena_attention(q, a.astype(jnp.int32), t, h, l, dk, dv, mask, kv_dtype=np.float32, **kw)
    with pytest.raises(ValueError, match="page_handles"):
        arena_attention(q, a, t, h[:1], l, dk, dv, mask, kv_dtype=np.float32, **kw)
    with pytest.raises(ValueError, match="page_size"):
        arena_attention(q, a, t, h, l, dk, dv, mask, kv_dtype=np.float32,
                        **{**kw, "page_size": 12})  # fmt: skip


@settings(max_examples=4, deadline=None)
@given(
    lens=st.lists(st.integers(1, 48), min_size=1, max_size=3),
    bf16=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_arena_attention_random_pages(lens, bf16, seed):
    """Random lengths (partial last pages), shuffled unit placements and unmapped tails: the
    arena kernel equals the dense-pages kernel."""
    rng = np.random.default_rng(seed)
    dtype = jnp.bfloat16 if bf16 else np.float32
    b, mp = len(lens), 3
    per_word = 2 if bf16 else 1
    unit_words = LAYERS * 2 * S * HKV * D // per_word
    arena = rng.integers(0, 2**32, (b * mp, unit_words + 64), dtype=np.uint32)
    segs = rng.permutation(b * mp)
    table = np.stack([segs, rng.integers(0, 64 - OFFSET, b * mp)], 1).astype(np.int32)
    handles = np.full((b, mp), -1, np.int32)
    k_pages = np.zeros((b * mp, S, HKV, D), np.float32)
    v_pages = np.zeros_like(k_pages)
    for r, length in enumerate(lens):
        for j in range(-(-length // S)):
            h = r * mp + j
            handles[r, j] = h
            unit = jnp.asarray(rng.standard_normal((LAYERS, 2, S, HKV, D)), dtype)
            live = ((j * S + np.arange(S)) < length)[:, None, None]
            k_pages[h] = np.asarray(unit[LAYER, 0].astype(jnp.float32)) * live
            v_pages[h] = np.asarray(unit[LAYER, 1].astype(jnp.float32)) * live
            seg, word = table[h]
            arena[seg, word + OFFSET : word + OFFSET + unit_words] = np.asarray(unit).reshape(
                -1).view(np.uint32)
    cast = lambda x: jnp.asarray(x, dtype)
    q = cast(rng.standard_normal((b, N, HQ, D)))
    dk, dv = (cast(rng.standard_normal((b, N, HKV, D))) for _ in range(2))
    mask = jnp.asarray(rng.random((b, N, N)) < 0.5) | jnp.eye(N, dtype=bool)
    pt = jnp.asarray(np.arange(b * mp, dtype=np.int32).reshape(b, mp))
    want = dense_attention(q, cast(k_pages), cast(v_pages), pt, jnp.asarray(lens), dk, dv, mask,
                           scale=0.25, interpret=True)  # fmt: skip
    got = arena_attention(
        q, jnp.asarray(arena), jnp.asarray(table), jnp.asarray(handles), jnp.asarray(lens),
        dk, dv, mask, layer=LAYER, kv_offset=OFFSET, page_size=S, kv_dtype=dtype, scale=0.25,
        interpret=True,
    )  # fmt: skip
    tol = 1e-2 if bf16 else 1e-6
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)),
                               np.asarray(want.astype(jnp.float32)), rtol=tol, atol=tol)  # fmt: skip
