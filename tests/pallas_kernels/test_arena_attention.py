"""Paged attention reading K/V pages inside a uint32 arena through the handle table
(pallas_kernels.attention.arena, interpret mode): the tree verify's against the dense-pages
kernel; decode's / prefill's (no draft tokens, causal) against a float64 reference and the
XLA path (``ArenaCache.attention``'s gather of the pages)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.attention.arena import paged_attention
from pallas_kernels.attention.arena import tree_attention as arena_attention
from pallas_kernels.attention.kernel import tree_attention as dense_attention
from serving.memory.model_cache import XLA_KERNELS, ArenaCache, ArenaKernels, ArenaSpec

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
            arena[seg, word + OFFSET : word + OFFSET + unit_words] = (
                np.asarray(unit).reshape(-1).view(np.uint32)
            )
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


# ------------------------------------------------ paged attention (no draft: decode, prefill)

MP = 4  # page-table width; the XLA path's softmax runs over MP * S keys
KERNEL = ArenaKernels(attention=True, interpret=True)  # ArenaCache.attention's kernel route


def _paged_setup(dtype, lens, seed):
    """An arena of garbage words (NaN patterns forced in), each row's pages at shuffled
    (segment, word) places; only the tokens ``< lens[r]`` hold K/V, the rest of every page
    (the tail of the last live page, whole pages past it: recycled) keeps the garbage. A row
    at length 0 is a padding row (no pages). Returns the arena pieces and the f64 K/V per row
    ``[MP * S, Hkv, D]`` (0 past the length)."""
    rng = np.random.default_rng(seed)
    b = len(lens)
    per_word = 1 if dtype == np.float32 else 2
    unit_words = LAYERS * 2 * S * HKV * D // per_word
    token_words = HKV * D // per_word
    arena = rng.integers(0, 2**32, (b * MP, unit_words + 64), dtype=np.uint32)
    arena[:, ::7] = 0x7FC00000  # NaN (f32 and the odd bf16 column)
    arena[:, 3::11] = 0xFFFF7FC0  # NaN in both bf16 halves
    segs = rng.permutation(b * MP)
    table = np.stack([segs, rng.integers(0, 64 - OFFSET, b * MP)], 1).astype(np.int32)
    handles = np.full((b, MP), -1, np.int32)
    kv = np.zeros((2, b, MP * S, HKV, D))
    for r, length in enumerate(lens):
        if length == 0:
            continue
        for j in range(min(MP, -(-length // S) + 1)):  # one recycled page past the live ones
            h = r * MP + j
            handles[r, j] = h
            vals = jnp.asarray(rng.standard_normal((LAYERS, 2, S, HKV, D)), dtype)
            words = np.asarray(vals).reshape(-1).view(np.uint32).reshape(LAYERS, 2, S, -1)
            seg, word = table[h] + [0, OFFSET]
            unit = arena[seg, word : word + unit_words].reshape(LAYERS, 2, S, token_words)
            live = j * S + np.arange(S) < length
            unit[:, :, live] = words[:, :, live]
            kv[:, r, j * S : (j + 1) * S] = (
                np.asarray(vals[LAYER].astype(jnp.float32)) * live[:, None, None]
            )
    return (jnp.asarray(arena), jnp.asarray(table), jnp.asarray(handles)), kv


def _paged_reference(q, kv, lens, q_pos, scale):
    """float64 ``attend`` over the ``MP * S`` keys: query t sees ``j < min(len, q_pos + 1)``;
    a query that sees nothing gets the uniform softmax (mean over all ``MP * S`` values)."""
    q = np.asarray(q.astype(jnp.float32), np.float64)
    k, v = kv
    b, t, hq, _ = q.shape
    out = np.zeros(q.shape)
    for r in range(b):
        for h in range(hq):
            kh, vh = k[r, :, h // (hq // HKV)], v[r, :, h // (hq // HKV)]
            for i in range(t):
                seen = np.arange(MP * S) < min(lens[r], q_pos[r, i] + 1)
                s = np.where(seen, kh @ q[r, i, h] * scale, -np.inf)
                p = np.exp(s - s.max()) if seen.any() else np.ones(MP * S)
                out[r, i, h] = p @ vh / p.sum()
    return out


def _xla_attention(parts, lens, q, q_pos, dtype, kernels):
    """``ArenaCache.attention`` (XLA gather, or the kernel per ``kernels``) on the arena."""
    arena, table, handles = parts
    spec = ArenaSpec(
        gdn_layers=0, state_shape=(), state_dtype="float32", state_offset=0, conv_shape=(),
        conv_dtype="float32", conv_offset=0, attn_layers=LAYERS, page_size=S, kv_heads=HKV,
        head_dim=D, kv_dtype=str(jnp.dtype(dtype)), kv_offset=OFFSET,
        model_dtype=str(q.dtype),
    )  # fmt: skip
    b = handles.shape[0]
    state = jnp.full((b,), -1, jnp.int32)
    cache = ArenaCache(arena, table, state, handles, jnp.asarray(lens), spec, kernels)
    return cache.attention(LAYER, q, jnp.asarray(lens, jnp.int32), jnp.asarray(q_pos), scale=0.25)


# decode: one query at the last position; prefill chunks: T queries from each row's start, the
# padding queries past num_tokens at positions >= kv_len (they see every committed key); row 2
# a fresh prompt over two query blocks (the first one walks one page); a row at length 0
# (padding: no pages) sees no key, and so does a query at q_pos -1
_CASES = {
    "decode": ([37, 16, 1, 0, 50], lambda lens, t: np.array(lens)[:, None] - 1, 1),
    "prefill": (
        [37, 16, 20, 0, 30],
        lambda lens, t: np.array([30, 10, 0, 0, 23])[:, None] + np.arange(t),
        20,  # two blocks of 16 queries
    ),
}


@pytest.mark.parametrize("case", ["decode", "prefill"])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_paged_attention_matches_f64_and_xla(case, dtype):
    lens, pos_of, t = _CASES[case]
    parts, kv = _paged_setup(dtype, lens, seed=len(lens) * t)
    q_pos = pos_of(lens, t).astype(np.int32)
    if case == "decode":
        q_pos[3] = 0  # the padding row (decode's engine input: length 0)
    else:
        q_pos[4, :2] = -1  # queries that see no key on a row with committed keys
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((len(lens), t, HQ, D)), dtype)
    got = paged_attention(
        q, *parts, jnp.asarray(lens), jnp.asarray(q_pos), layer=LAYER, kv_offset=OFFSET,
        page_size=S, kv_heads=HKV, kv_dtype=dtype, scale=0.25, block_q=16, interpret=True,
    )  # fmt: skip
    assert got.shape == q.shape and got.dtype == q.dtype
    got = np.asarray(got.astype(jnp.float32))
    assert np.all(np.isfinite(got))
    tol = 1e-5 if dtype == np.float32 else 1e-2
    np.testing.assert_allclose(got, _paged_reference(q, kv, lens, q_pos, 0.25), rtol=tol, atol=tol)
    assert not got[3].any()  # the padding row: 0, as XLA gives it
    # the XLA path (the gather) and the cache's kernel route give the same
    xla = _xla_attention(parts, lens, q, q_pos, dtype, XLA_KERNELS)
    routed = _xla_attention(parts, lens, q, q_pos, dtype, KERNEL)
    xla, routed = (np.asarray(x.astype(jnp.float32)) for x in (xla, routed))
    np.testing.assert_allclose(got, xla, rtol=2 * tol, atol=2 * tol)
    np.testing.assert_array_equal(routed[3], xla[3])
    np.testing.assert_allclose(routed, got, rtol=tol, atol=tol)


def test_paged_attention_route_guard():
    """Queries the kernel cannot take go to XLA, or raise when strict."""
    lens = [20]
    parts, _ = _paged_setup(np.float32, lens, seed=3)
    q = jnp.ones((1, 1, HQ, D), jnp.int32)  # not a float type: the kernel's guard refuses it
    pos = np.array([[19]], np.int32)
    with pytest.raises(ValueError, match="paged attention kernel"):
        _xla_attention(parts, lens, q, pos, np.float32, dataclasses.replace(KERNEL, strict=True))
    # traced, not run: XLA's int32 einsum has no GPU GEMM, and the route is what is tested here
    jaxpr = jax.make_jaxpr(lambda: _xla_attention(parts, lens, q, pos, np.float32, KERNEL))()
    assert "pallas_call" not in str(jaxpr)
    assert jaxpr.out_avals[0].shape == q.shape
    qf = q.astype(jnp.float32)  # the control: float queries do take the kernel
    assert "pallas_call" in str(
        jax.make_jaxpr(lambda: _xla_attention(parts, lens, qf, pos, np.float32, KERNEL))()
    )
    kw = dict(layer=LAYER, kv_offset=OFFSET, page_size=S, kv_heads=HKV, kv_dtype=np.float32,
              scale=0.25, interpret=True)  # fmt: skip
    q, lens = q.astype(jnp.float32), jnp.asarray(lens)
    with pytest.raises(ValueError, match="block_q"):
        paged_attention(q, *parts, lens, jnp.asarray(pos), block_q=8, **kw)
    with pytest.raises(ValueError, match="q_pos"):
        paged_attention(q, *parts, lens, jnp.zeros((1, 2), jnp.int32), **kw)
