"""The paged attention kernels (``pallas_kernels.attention``, interpret mode).

- ``kernel.py`` (tree attention over dense pages) against the XLA path
  (``gdn_jax.models.tree_attention.paged_attention``) and ``attention/reference.py``;
- ``arena.py``, K/V pages read inside a uint32 arena through the handle table: the tree
  verify's against the dense-pages kernel and its reference; decode's / prefill's (no draft
  tokens, causal) against a float64 reference, its reference and the XLA path
  (``ArenaCache.attention``'s gather of the pages);
- ``attention/reference.py`` itself against float64 numpy attention.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gdn_jax import ancestor_closure
from gdn_jax.models.tree_attention import paged_attention as xla_paged_attention
from pallas_kernels.attention.arena import paged_attention
from pallas_kernels.attention.arena import tree_attention as arena_attention
from pallas_kernels.attention.kernel import tree_attention as dense_attention
from pallas_kernels.attention.reference import (
    paged_attention_arena_reference,
    paged_attention_reference,
    paged_tree_attention_reference,
    tree_attention_arena_reference,
)
from serving.arena_cache import ArenaCache
from serving.arena_spec import ArenaSpec
from serving.kernels import XLA_KERNELS, ArenaKernels
from tests.gdn_jax.reference import rel_err

B, N, HQ, HKV, D, S, LAYERS, LAYER, OFFSET = 2, 5, 4, 2, 16, 16, 2, 1, 10


def _attend64(q, k, v, seen, scale):
    """float64 attention: ``q [B, T, Hq, D]``, ``k, v [B, L, Hkv, D]``, ``seen bool [B, T, L]``;
    a query that sees no key gets the uniform softmax over all ``L`` keys."""
    q, k, v = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v))
    b, t, hq, _ = q.shape
    grp = hq // k.shape[2]
    out = np.zeros(q.shape)
    for r in range(b):
        for h in range(hq):
            for i in range(t):
                s = np.where(seen[r, i], k[r, :, h // grp] @ q[r, i, h] * scale, -np.inf)
                p = np.exp(s - s.max()) if seen[r, i].any() else np.ones(len(s))
                out[r, i, h] = p @ v[r, :, h // grp] / p.sum()
    return out


# ------------------------------------------------------- tree attention over dense pages


def _dense_tree_case(n, lengths, dtype, rng):
    """Random tree attention inputs over shuffled dense pages (``S`` 4, 6 pages per row; row
    1's last node is padding): ``(args, parents, scale)``."""
    b, hq, hkv, d, s, mp = 2, 4, 2, 16, 4, 6
    pages = b * mp + 1
    parents = np.stack([[-1] + [int(rng.integers(-1, i)) for i in range(1, n)] for _ in range(b)])
    parents[1, -1] = -2  # a padding node
    incl = ancestor_closure(jnp.asarray(parents, jnp.int32))
    table = rng.permutation(pages)[: b * mp].reshape(b, mp).astype(np.int32)
    r = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
    q, dk, dv = r(b, n, hq, d), r(b, n, hkv, d), r(b, n, hkv, d)
    kp, vp = r(pages, s, hkv, d), r(pages, s, hkv, d)
    args = (q, kp, vp, jnp.asarray(table), jnp.asarray(lengths, jnp.int32), dk, dv, incl)
    return args, parents, d**-0.5


@pytest.mark.parametrize(
    "n, lengths, dtype",
    [(8, (13, 0), jnp.float32), (5, (16, 3), jnp.float32), (8, (7, 9), jnp.bfloat16)],
)
def test_tree_matches_xla_and_reference(n, lengths, dtype):
    """The dense-pages kernel equals the XLA path and ``paged_tree_attention_reference`` on the
    real nodes (random trees, a padding node, a row with no committed key)."""
    args, parents, scale = _dense_tree_case(n, lengths, dtype, np.random.default_rng(n))
    q, kp, vp, table, kv_len, dk, dv, incl = args
    depth = jnp.sum(incl, axis=-1) - 1
    draft = dict(draft_k=dk, draft_v=dv, draft_mask=incl)
    q_pos = kv_len[:, None] + depth
    want = xla_paged_attention(q, kp, vp, table, kv_len, q_pos, scale=scale, **draft)
    got = dense_attention(*args, scale=scale, interpret=True)
    assert got.shape == want.shape and got.dtype == dtype
    real = np.asarray(parents) != -2
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    got32 = np.asarray(got, np.float32)
    assert rel_err(got32[real], np.asarray(want, np.float32)[real]) < tol
    assert np.isfinite(got32).all()
    ref = np.asarray(paged_tree_attention_reference(*args, scale=scale), np.float32)
    assert rel_err(got32[real], ref[real]) < tol


def test_tree_jits():
    b, n, hq, hkv, d, s = 1, 4, 2, 1, 16, 4
    z = lambda *shape: jnp.ones(shape, jnp.float32)
    f = jax.jit(lambda *a: dense_attention(*a, scale=0.25, interpret=True))
    pages = (z(3, s, hkv, d), z(3, s, hkv, d), jnp.zeros((b, 3), jnp.int32))
    draft = (z(b, n, hkv, d), z(b, n, hkv, d), jnp.eye(n, dtype=bool)[None])
    out = f(z(b, n, hq, d), *pages, jnp.asarray([5], jnp.int32), *draft)
    np.testing.assert_allclose(out, 1.0, rtol=1e-6)


# ----------------------------------------------------- tree attention over the arena's pages


def _unit_words(dtype):
    """Words of one KV unit ``[La, 2, S, Hkv, D]`` in ``dtype`` (bf16: two per word)."""
    return LAYERS * 2 * S * HKV * D // (1 if dtype == np.float32 else 2)


def _store_unit(arena, table, h, unit):
    """Writes the KV unit ``unit`` at handle ``h``'s place (``OFFSET`` words into it)."""
    seg, word = table[h]
    words = np.asarray(unit).reshape(-1).view(np.uint32)
    arena[seg, word + OFFSET : word + OFFSET + words.size] = words


def _live_layer(unit, first, length):
    """f32 K and V ``[S, Hkv, D]`` of layer ``LAYER`` of a unit holding tokens ``first..``,
    zeroed at tokens ``>= length``."""
    live = ((first + np.arange(S)) < length)[:, None, None]
    return (np.asarray(unit[LAYER, i].astype(jnp.float32)) * live for i in (0, 1))


def _setup(dtype, seed=0):
    rng = np.random.default_rng(seed)
    lens = np.array([37, 16])  # row 0 ends inside its third page; row 1 fills one page exactly
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
            k_pages[r * 3 + j], v_pages[r * 3 + j] = _live_layer(unit, j * S, lens[r])
            _store_unit(arena, table, handles[r, j], unit)
    dense_table = np.arange(B * 3, dtype=np.int32).reshape(B, 3)
    cast = lambda x: jnp.asarray(x, dtype)
    q = cast(rng.standard_normal((B, N, HQ, D)))
    dk, dv = (cast(rng.standard_normal((B, N, HKV, D))) for _ in range(2))
    mask = jnp.asarray(np.broadcast_to(np.tril(np.ones((N, N), bool)), (B, N, N)))
    dense = (cast(k_pages), cast(v_pages), jnp.asarray(dense_table))
    return q, dk, dv, mask, lens, (arena, table, handles), dense


def _arena_tree(q, parts, lens, dk, dv, mask, dtype, reference=False):
    """The arena tree attention kernel (or its reference) on layer ``LAYER``, scale 0.25."""
    arena, table, handles = (jnp.asarray(x) for x in parts)
    args = (q, arena, table, handles, jnp.asarray(lens), dk, dv, mask)
    kw = dict(layer=LAYER, kv_offset=OFFSET, page_size=S, kv_dtype=dtype, scale=0.25)
    if reference:
        return tree_attention_arena_reference(*args, **kw)
    return arena_attention(*args, **kw, interpret=True)


@pytest.mark.parametrize("dtype, tol", [(np.float32, 1e-6), (jnp.bfloat16, 1e-2)])
def test_arena_tree_matches_dense_pages(dtype, tol):
    """The arena kernel equals the dense-pages kernel on the same K/V, and its reference."""
    q, dk, dv, mask, lens, parts, (kp, vp, pt) = _setup(dtype)
    want = dense_attention(
        q, kp, vp, pt, jnp.asarray(lens), dk, dv, mask, scale=0.25, interpret=True
    )
    got = _arena_tree(q, parts, lens, dk, dv, mask, dtype)
    assert got.shape == want.shape and got.dtype == want.dtype
    got, want = np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32))
    assert np.all(np.isfinite(got))  # garbage past kv_len never leaks in
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    ref = _arena_tree(q, parts, lens, dk, dv, mask, dtype, reference=True)
    np.testing.assert_allclose(got, np.asarray(ref.astype(jnp.float32)), rtol=tol, atol=tol)


def test_arena_bad_inputs_raise():
    q, dk, dv, mask, lens, (arena, table, handles), _ = _setup(np.float32)
    a, t, h, l = (jnp.asarray(x) for x in (arena, table, handles, lens))

    where = dict(layer=LAYER, kv_offset=OFFSET, scale=0.25, interpret=True)

    def run(a=a, h=h, kv_dtype=np.float32, page_size=S):
        args = (q, a, t, h, l, dk, dv, mask)
        return arena_attention(*args, page_size=page_size, kv_dtype=kv_dtype, **where)

    with pytest.raises(ValueError, match="kv_dtype"):
        run(kv_dtype=jnp.int8)
    with pytest.raises(ValueError, match="arena:"):
        run(a=a.astype(jnp.int32))
    with pytest.raises(ValueError, match="page_handles"):
        run(h=h[:1])
    with pytest.raises(ValueError, match="page_size"):
        run(page_size=12)


@settings(max_examples=4, deadline=None)
@given(
    lens=st.lists(st.integers(1, 48), min_size=1, max_size=3),
    bf16=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_arena_tree_random_pages(lens, bf16, seed):
    """Random lengths (partial last pages), shuffled unit placements and unmapped tails: the
    arena kernel equals the dense-pages kernel and its reference."""
    rng = np.random.default_rng(seed)
    dtype = jnp.bfloat16 if bf16 else np.float32
    b, mp = len(lens), 3
    arena = rng.integers(0, 2**32, (b * mp, _unit_words(dtype) + 64), dtype=np.uint32)
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
            k_pages[h], v_pages[h] = _live_layer(unit, j * S, length)
            _store_unit(arena, table, h, unit)
    cast = lambda x: jnp.asarray(x, dtype)
    q = cast(rng.standard_normal((b, N, HQ, D)))
    dk, dv = (cast(rng.standard_normal((b, N, HKV, D))) for _ in range(2))
    mask = jnp.asarray(rng.random((b, N, N)) < 0.5) | jnp.eye(N, dtype=bool)
    pt = jnp.asarray(np.arange(b * mp, dtype=np.int32).reshape(b, mp))
    pages = (cast(k_pages), cast(v_pages), pt, jnp.asarray(lens))
    want = dense_attention(q, *pages, dk, dv, mask, scale=0.25, interpret=True)
    parts = (arena, table, handles)
    got = _arena_tree(q, parts, lens, dk, dv, mask, dtype)
    ref = _arena_tree(q, parts, lens, dk, dv, mask, dtype, reference=True)
    tol = 1e-2 if bf16 else 1e-6
    got, want, ref = (np.asarray(x.astype(jnp.float32)) for x in (got, want, ref))
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    np.testing.assert_allclose(got, ref, rtol=max(tol, 1e-5), atol=max(tol, 1e-5))


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
    unit_words = _unit_words(dtype)
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
        gdn_layers=0,
        state_shape=(),
        state_dtype="float32",
        state_offset=0,
        conv_shape=(),
        conv_dtype="float32",
        conv_offset=0,
        attn_layers=LAYERS,
        page_size=S,
        kv_heads=HKV,
        head_dim=D,
        kv_dtype=str(jnp.dtype(dtype)),
        kv_offset=OFFSET,
        model_dtype=str(q.dtype),
    )
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
_PAGED = dict(layer=LAYER, kv_offset=OFFSET, page_size=S, kv_heads=HKV, scale=0.25)


@pytest.mark.parametrize("case", ["decode", "prefill"])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_paged_matches_f64_reference_and_xla(case, dtype):
    lens, pos_of, t = _CASES[case]
    parts, kv = _paged_setup(dtype, lens, seed=len(lens) * t)
    q_pos = pos_of(lens, t).astype(np.int32)
    if case == "decode":
        q_pos[3] = 0  # the padding row (decode's engine input: length 0)
    else:
        q_pos[4, :2] = -1  # queries that see no key on a row with committed keys
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((len(lens), t, HQ, D)), dtype)
    rows = (jnp.asarray(lens), jnp.asarray(q_pos))
    got = paged_attention(q, *parts, *rows, **_PAGED, kv_dtype=dtype, block_q=16, interpret=True)
    assert got.shape == q.shape and got.dtype == q.dtype
    got = np.asarray(got.astype(jnp.float32))
    assert np.all(np.isfinite(got))
    tol = 1e-5 if dtype == np.float32 else 1e-2
    np.testing.assert_allclose(got, _paged_reference(q, kv, lens, q_pos, 0.25), rtol=tol, atol=tol)
    assert not got[3].any()  # the padding row: 0, as XLA gives it
    ref = paged_attention_arena_reference(q, *parts, *rows, **_PAGED, kv_dtype=dtype)
    np.testing.assert_allclose(got, np.asarray(ref.astype(jnp.float32)), rtol=tol, atol=tol)
    # the XLA path (the gather) and the cache's kernel route give the same
    xla = _xla_attention(parts, lens, q, q_pos, dtype, XLA_KERNELS)
    routed = _xla_attention(parts, lens, q, q_pos, dtype, KERNEL)
    xla, routed = (np.asarray(x.astype(jnp.float32)) for x in (xla, routed))
    np.testing.assert_allclose(got, xla, rtol=2 * tol, atol=2 * tol)
    np.testing.assert_array_equal(routed[3], xla[3])
    np.testing.assert_allclose(routed, got, rtol=tol, atol=tol)


def test_paged_route_guard():
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
    kw = dict(**_PAGED, kv_dtype=np.float32, interpret=True)
    q, lens = q.astype(jnp.float32), jnp.asarray(lens)
    with pytest.raises(ValueError, match="block_q"):
        paged_attention(q, *parts, lens, jnp.asarray(pos), block_q=8, **kw)
    with pytest.raises(ValueError, match="q_pos"):
        paged_attention(q, *parts, lens, jnp.zeros((1, 2), jnp.int32), **kw)


# --------------------------------------------------------------- the reference vs float64


@settings(max_examples=4, deadline=None)
@given(
    lens=st.lists(st.integers(0, 12), min_size=1, max_size=3),
    heads=st.sampled_from([(1, 1), (4, 2), (3, 1)]),
    n=st.sampled_from([1, 3]),
    seed=st.integers(0, 999),
)
def test_reference_matches_float64(lens, heads, n, seed):
    """``attention/reference.py``: tree attention (committed keys below ``kv_len`` plus the
    draft keys of the mask) and causal paged attention (keys ``j <= q_pos``; queries that see
    no key: the uniform softmax) equal float64 attention over the gathered pages."""
    rng = np.random.default_rng(seed)
    hq, hkv = heads
    b, s, mp, d = len(lens), 4, 3, 8
    kv_len = np.asarray(lens, np.int32)
    pages = rng.standard_normal((2, b * mp + 1, s, hkv, d)).astype(np.float32)
    table = rng.permutation(b * mp + 1)[: b * mp].reshape(b, mp).astype(np.int32)
    q = rng.standard_normal((b, n, hq, d)).astype(np.float32)
    draft = rng.standard_normal((2, b, n, hkv, d)).astype(np.float32)
    mask = (rng.random((b, n, n)) < 0.5) | np.eye(n, dtype=bool)
    live = np.arange(mp * s)[None, :] < kv_len[:, None]  # [B, MP * S]
    k, v = (np.where(live[..., None, None], p[table].reshape(b, mp * s, hkv, d), 0) for p in pages)
    args = (jnp.asarray(pages[0]), jnp.asarray(pages[1]), jnp.asarray(table), jnp.asarray(kv_len))

    tree = paged_tree_attention_reference(
        jnp.asarray(q), *args, *(jnp.asarray(x) for x in draft), jnp.asarray(mask), scale=0.3
    )
    seen = np.concatenate([np.broadcast_to(live[:, None], (b, n, mp * s)), mask], -1)
    want = _attend64(
        q, np.concatenate([k, draft[0]], 1), np.concatenate([v, draft[1]], 1), seen, 0.3
    )
    assert rel_err(tree, want) < 1e-5

    q_pos = rng.integers(-1, mp * s, (b, n)).astype(np.int32)
    causal = paged_attention_reference(jnp.asarray(q), *args, jnp.asarray(q_pos), scale=0.3)
    seen = live[:, None] & (np.arange(mp * s)[None, None, :] <= q_pos[:, :, None])
    want = _attend64(q, k, v, seen, 0.3)
    np.testing.assert_allclose(np.asarray(causal), want, rtol=1e-5, atol=1e-6)
