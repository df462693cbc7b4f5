"""The paged attention kernels (``pallas_kernels.attention``, interpret mode).

- ``kernel.py`` (tree attention over dense pages) against the XLA path
  (``gdn_jax.models.tree_attention.paged_attention``) and ``attention/reference.py``;
- ``arena.py``, K/V pages read inside a uint32 arena through the handle table: the tree
  verify's against the dense-pages kernel and its reference; decode's / prefill's (no draft
  tokens, causal) against a float64 reference, its reference and the XLA path
  (``ArenaCache.attention``'s gather of the pages); the grouped-query tiles, several pages per
  loop step and bf16 dots at other knob values, decode's key splits (against one split and
  the float64 reference; the automatic count), the knobs' checks, and the Triton lowering for
  sm_90 at Qwen3.5 attention dims;
- ``attention/reference.py`` itself against float64 numpy attention.
"""

from __future__ import annotations

import dataclasses
import sys

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


@pytest.mark.parametrize("page", [48, 80])
@pytest.mark.parametrize("case", ["decode", "prefill"])
def test_pages_not_a_power_of_two(monkeypatch, case, page):
    """Pages of a multiple of 16 tokens that is not a power of two (a padded unified pool's,
    enlarged to hold a state): the key tiles start and end inside pages. Against float64, the
    reference, the XLA path and the cache's kernel route; the tree verify's against its
    reference on the same pages."""
    monkeypatch.setattr(sys.modules[__name__], "S", page)  # the helpers' page size
    dtype = jnp.bfloat16
    lens, pos_of, t = _CASES[case]
    lens = [x * page // 16 + 5 for x in lens[:3]] + [0, 3 * page + 7]  # across pages, a padding row
    lens = [min(x, MP * page) for x in lens]
    parts, kv = _paged_setup(dtype, lens, seed=page + t)
    q_pos = (
        pos_of(lens, t).astype(np.int32)
        if case == "decode"
        else (np.array([lens[0] - t, 2, 0, 0, page - 3])[:, None] + np.arange(t)).astype(np.int32)
    )
    if case == "decode":
        q_pos[3] = 0  # the padding row
    rng = np.random.default_rng(page)
    q = jnp.asarray(rng.standard_normal((len(lens), t, HQ, D)), dtype)
    rows = (jnp.asarray(lens), jnp.asarray(q_pos))
    kw = {**_PAGED, "page_size": page, "kv_dtype": dtype}
    got = paged_attention(q, *parts, *rows, **kw, interpret=True)
    got = np.asarray(got.astype(jnp.float32))
    assert np.all(np.isfinite(got))
    want = _paged_reference(q, kv, lens, q_pos, 0.25)
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)
    ref = paged_attention_arena_reference(q, *parts, *rows, **kw)
    np.testing.assert_allclose(got, np.asarray(ref.astype(jnp.float32)), rtol=1e-2, atol=1e-2)
    xla = _xla_attention(parts, lens, q, q_pos, dtype, XLA_KERNELS)
    routed = _xla_attention(parts, lens, q, q_pos, dtype, KERNEL)
    np.testing.assert_allclose(np.asarray(routed.astype(jnp.float32)), got, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(xla.astype(jnp.float32)), got, rtol=2e-2, atol=2e-2)
    if case == "decode":  # the tree verify's kernel over the same pages
        n = 4
        dk, dv = (jnp.asarray(rng.standard_normal((len(lens), n, HKV, D)), dtype) for _ in "kv")
        tq = jnp.asarray(rng.standard_normal((len(lens), n, HQ, D)), dtype)
        mask = jnp.asarray(rng.random((len(lens), n, n)) < 0.5) | jnp.eye(n, dtype=bool)
        args = (tq, *parts, jnp.asarray(lens), dk, dv, mask)
        tkw = dict(layer=LAYER, kv_offset=OFFSET, page_size=page, kv_dtype=dtype, scale=0.25)
        tgot = np.asarray(arena_attention(*args, **tkw, interpret=True).astype(jnp.float32))
        tref = np.asarray(tree_attention_arena_reference(*args, **tkw).astype(jnp.float32))
        np.testing.assert_allclose(tgot, tref, rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="^pages_per_step: only for a power-of-two"):
        paged_attention(q, *parts, *rows, **kw, pages_per_step=2, interpret=True)
    with pytest.raises(ValueError, match="^page_size: a multiple of 16"):
        paged_attention(q, *parts, *rows, **{**kw, "page_size": page + 8}, interpret=True)


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
        paged_attention(q, *parts, lens, jnp.asarray(pos), block_q=12, **kw)
    with pytest.raises(ValueError, match="q_pos"):
        paged_attention(q, *parts, lens, jnp.zeros((1, 2), jnp.int32), **kw)


# ------------------------------- grouped-query tiles, several pages per step, bf16 dots

# (case, Hq (group Hq / 2), block_q, pages_per_step, q dtype, cache dtype): decode at group 4
# (4 real rows of 16: padding rows) and 8; prefill T 20 over blocks of 2 queries (8 real rows
# of 16) and of 4 (16 rows); steps of 1, 2 (32 keys: lengths 37 and 50 end inside a step) and
# 8 pages (wider than the 4-page table: padded); bf16 q over a bf16 cache (bf16 dots), f32 q
# over a bf16 cache (the precise path); None: the defaults
_GQA_CASES = [
    ("decode", 8, None, 2, np.float32, np.float32),
    ("decode", 16, None, None, jnp.bfloat16, jnp.bfloat16),
    ("decode", 4, None, 1, np.float32, jnp.bfloat16),
    ("prefill", 8, 2, 2, jnp.bfloat16, jnp.bfloat16),
    ("prefill", 8, 4, 8, np.float32, np.float32),
    ("prefill", 16, None, None, jnp.bfloat16, jnp.bfloat16),
]


def _unmap(parts, kv, row, page):
    """Unmaps ``row``'s logical ``page`` (handle -1: reads as zeros, the XLA path's gather)."""
    arena, table, handles = parts
    kv = kv.copy()
    kv[:, row, page * S : (page + 1) * S] = 0
    return (arena, table, handles.at[row, page].set(-1)), kv


def _paged_case(case, kv_dtype, seed):
    """``(lens, parts, kv, q_pos, T)`` of a ``_CASES`` case: row 0's second page unmapped (below
    its length); at decode row 3 queries position 0, at prefill row 4's first two queries see
    no key."""
    lens, pos_of, t = _CASES[case]
    parts, kv = _paged_setup(kv_dtype, lens, seed=seed)
    parts, kv = _unmap(parts, kv, 0, 1)
    q_pos = pos_of(lens, t).astype(np.int32)
    if case == "decode":
        q_pos[3] = 0
    else:
        q_pos[4, :2] = -1
    return lens, parts, kv, q_pos, t


@pytest.mark.parametrize("case, hq, block_q, steps, q_dtype, kv_dtype", _GQA_CASES)
def test_paged_gqa_tiles_and_page_steps(case, hq, block_q, steps, q_dtype, kv_dtype):
    """Several query heads per KV head stacked in one tile, several pages per loop step
    (lengths not a multiple of it), an unmapped page below the length (row 0's second), a row
    at length 0 and queries that see no key: equal to the float64 reference and the arena
    reference."""
    lens, parts, kv, q_pos, t = _paged_case(case, kv_dtype, seed=hq + _CASES[case][2])
    rng = np.random.default_rng(hq)
    q = jnp.asarray(rng.standard_normal((len(lens), t, hq, D)), q_dtype)
    rows = (jnp.asarray(lens), jnp.asarray(q_pos))
    knobs = dict(block_q=block_q, pages_per_step=steps, interpret=True)
    got = paged_attention(q, *parts, *rows, **_PAGED, kv_dtype=kv_dtype, **knobs)
    assert got.shape == q.shape and got.dtype == q.dtype
    got = np.asarray(got.astype(jnp.float32))
    assert np.all(np.isfinite(got))
    tol = 1e-5 if q_dtype == np.float32 else 1e-2
    np.testing.assert_allclose(got, _paged_reference(q, kv, lens, q_pos, 0.25), rtol=tol, atol=tol)
    assert not got[3].any()  # the row at length 0
    ref = paged_attention_arena_reference(q, *parts, *rows, **_PAGED, kv_dtype=kv_dtype)
    np.testing.assert_allclose(got, np.asarray(ref.astype(jnp.float32)), rtol=tol, atol=tol)


def _grid(fn, *args):
    """The grid of the one ``pallas_call`` that ``fn(*args)`` traces to."""
    [eqn] = [e for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns if e.primitive.name == "pallas_call"]
    return tuple(eqn.params["grid_mapping"].grid)


# (case, num_splits, block_q, q dtype = cache dtype), one page per step (16 keys: the 4-page
# table has 4 steps; rows of 3, 1, 1, 0 and 4 steps at decode): 3 splits take row 0's steps
# 1 + 1 + 1, row 4's 2 + 2 + 0 and row 1's 1 + 0 + 0 (splits past the length), 8 are more
# splits than any row has steps; prefill T 20 in blocks of 4 queries, whose first blocks'
# causal bounds leave the later splits empty, queries that see no key (the uniform softmax
# over the splits' walked values)
_SPLIT_CASES = [
    ("decode", 3, None, np.float32),
    ("decode", 8, None, jnp.bfloat16),
    ("prefill", 3, 4, np.float32),
]


@pytest.mark.parametrize("case, splits, block_q, dtype", _SPLIT_CASES)
def test_paged_key_splits_match_one_split_and_f64(case, splits, block_q, dtype):
    """``num_splits`` key splits per program, merged after the kernel (group 4, ragged
    lengths, an unmapped page below row 0's length, a row at length 0, splits wholly past a
    row's length or a block's causal bound): the grid has the split axis, and the result equals
    the one-split kernel and the float64 reference."""
    lens, parts, kv, q_pos, t = _paged_case(case, dtype, seed=splits + _CASES[case][2])
    q = jnp.asarray(np.random.default_rng(splits).standard_normal((len(lens), t, 8, D)), dtype)
    rows = (jnp.asarray(lens), jnp.asarray(q_pos))
    kw = dict(**_PAGED, kv_dtype=dtype, block_q=block_q, pages_per_step=1, interpret=True)

    def run(n):
        return paged_attention(q, *parts, *rows, **kw, num_splits=n)

    assert len(_grid(lambda: run(1))) == 3
    assert _grid(lambda: run(splits))[3] == splits
    got, one = run(splits), run(1)
    assert got.shape == q.shape and got.dtype == q.dtype
    got, one = (np.asarray(x.astype(jnp.float32)) for x in (got, one))
    assert np.all(np.isfinite(got))
    assert not got[3].any()  # the row at length 0
    tol = 1e-6 if dtype == np.float32 else 1e-2
    np.testing.assert_allclose(got, one, rtol=tol, atol=tol)
    want = _paged_reference(q, kv, lens, q_pos, 0.25)
    np.testing.assert_allclose(got, want, rtol=max(tol, 1e-5), atol=max(tol, 1e-5))


def test_paged_auto_splits():
    """``num_splits=None`` splits the keys of a single query block on a small grid, as many
    splits as fill ``TARGET_PROGRAMS`` programs, at most the page table's loop steps: B 1
    decode takes 4 splits of the 4-step table (equal to one split and the float64 reference);
    at Qwen3.5 attention dims B 1 and 16 decode split, B 64 decode and a prefill chunk do
    not."""
    lens = [50]
    parts, kv = _paged_setup(np.float32, lens, seed=7)
    q = jnp.asarray(np.random.default_rng(7).standard_normal((1, 1, HQ, D)), jnp.float32)
    q_pos = np.array([[49]], np.int32)
    rows = (jnp.asarray(lens), jnp.asarray(q_pos))
    kw = dict(**_PAGED, kv_dtype=np.float32, pages_per_step=1, interpret=True)
    auto = lambda: paged_attention(q, *parts, *rows, **kw)
    assert _grid(auto) == (1, HKV, 1, MP)
    got = np.asarray(auto())
    np.testing.assert_allclose(
        got, np.asarray(paged_attention(q, *parts, *rows, **kw, num_splits=1)), 1e-6, 1e-6
    )
    want = _paged_reference(q, kv, lens, q_pos, 0.25)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    s, i32, bf16 = jax.ShapeDtypeStruct, jnp.int32, jnp.bfloat16
    qwen = dict(layer=0, kv_offset=0, page_size=16, kv_heads=2, kv_dtype=bf16, scale=0.0625)

    def grid(b, t, mp):
        args = (s((b, t, 16, 256), bf16), s((8, 1 << 20), jnp.uint32), s((64, 2), i32))
        args += (s((b, mp), i32), s((b,), i32), s((b, t), i32))
        return _grid(lambda *a: paged_attention(*a, **qwen), *args)

    # decode steps of 8 pages (128 keys): a 32-page table has 4 steps, a 256-page one 32
    assert grid(1, 1, 32) == (1, 2, 1, 4)
    assert grid(1, 1, 256) == (1, 2, 1, 32)
    assert grid(16, 1, 256) == (16, 2, 1, 4)
    assert grid(64, 1, 256) == (64, 2, 1)
    assert grid(1, 512, 256) == (1, 2, 64)


@pytest.mark.parametrize("dtype, tol", [(np.float32, 1e-6), (jnp.bfloat16, 1e-2)])
def test_arena_tree_gqa_tiles_and_page_steps(dtype, tol):
    """The tree verify at group 4 (two nodes per program: 8 real rows of 16), two pages per
    step, row 0's second page unmapped below its length: equal to the dense-pages kernel on the
    same K/V (zeros for the unmapped page) and to the arena reference."""
    q, dk, dv, mask, lens, (arena, table, handles), (kp, vp, pt) = _setup(dtype, seed=4)
    handles = handles.copy()
    handles[0, 1] = -1
    kp, vp = kp.at[1].set(0), vp.at[1].set(0)  # row 0's page 1 in the dense form
    q = jnp.asarray(np.random.default_rng(5).standard_normal((B, N, 2 * HQ, D)), dtype)
    parts = (arena, table, handles)
    a, t, h = (jnp.asarray(x) for x in parts)
    args = (q, a, t, h, jnp.asarray(lens), dk, dv, mask)
    kw = dict(layer=LAYER, kv_offset=OFFSET, page_size=S, kv_dtype=dtype, scale=0.25)
    got = arena_attention(*args, **kw, block_q=2, pages_per_step=2, interpret=True)
    want = dense_attention(
        q, kp, vp, pt, jnp.asarray(lens), dk, dv, mask, scale=0.25, interpret=True
    )
    assert got.shape == want.shape and got.dtype == want.dtype
    got, want = np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32))
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    ref = tree_attention_arena_reference(*args, **kw)
    np.testing.assert_allclose(got, np.asarray(ref.astype(jnp.float32)), rtol=tol, atol=tol)


def test_arena_attention_bad_knobs_raise():
    """``block_q`` and ``pages_per_step``: powers of two >= 1, ``num_splits`` an int >= 1,
    else a ValueError naming them."""
    lens = [20]
    parts, _ = _paged_setup(np.float32, lens, seed=3)
    q = jnp.ones((1, 1, HQ, D), jnp.float32)
    rows = (jnp.asarray(lens), jnp.asarray([[19]], jnp.int32))
    kw = dict(**_PAGED, kv_dtype=np.float32, interpret=True)
    for bad in (0, 3, -4, 2.0):
        with pytest.raises(ValueError, match="^pages_per_step: a power of two"):
            paged_attention(q, *parts, *rows, pages_per_step=bad, **kw)
        with pytest.raises(ValueError, match="^block_q: a power of two"):
            paged_attention(q, *parts, *rows, block_q=bad, **kw)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="^num_splits: an int >= 1"):
            paged_attention(q, *parts, *rows, num_splits=bad, **kw)
    tq, dk, dv, mask, tree_lens, tree_parts, _ = _setup(np.float32)
    for name in ("pages_per_step", "block_q"):
        with pytest.raises(ValueError, match=f"^{name}: a power of two"):
            _arena_tree_knob(tq, tree_parts, tree_lens, dk, dv, mask, **{name: 6})


def _arena_tree_knob(q, parts, lens, dk, dv, mask, **knobs):
    arena, table, handles = (jnp.asarray(x) for x in parts)
    args = (q, arena, table, handles, jnp.asarray(lens), dk, dv, mask)
    kw = dict(layer=LAYER, kv_offset=OFFSET, page_size=S, kv_dtype=np.float32, scale=0.25)
    return arena_attention(*args, **kw, **knobs, interpret=True)


@pytest.mark.parametrize(
    "case, t, rows, keys, splits",
    [
        ("decode", 1, 16, 128, None),  # group 8 in one 16-row tile, 8 pages per step; split
        ("decode", 1, 16, 128, 1),  # the same in one program per row and KV head
        ("prefill", 512, 64, 64, None),  # 8 queries x 8 heads, 4 pages per step
        ("tree", 64, 64, 64, None),  # 8 nodes x 8 heads; the draft keys: one 64-node tile
    ],
)
def test_arena_attention_lowers_for_sm90(h200, case, t, rows, keys, splits):
    """Qwen3.5-35B-A3B attention dims (Hq 16, Hkv 2, D 256, bf16 cache, S 16), default knobs
    (decode also in one split): the kernels lower to Triton IR for sm_90 with ``rows`` query
    rows, ``keys`` keys per step and bf16 dot operands (the even/odd halves: 128 columns)."""
    s, i32, bf16 = jax.ShapeDtypeStruct, jnp.int32, jnp.bfloat16
    b, hq, hkv, d, mp = 2, 16, 2, 256, 256
    pages = (s((8, 1 << 20), jnp.uint32), s((64, 2), i32), s((b, mp), i32), s((b,), i32))
    kw = dict(layer=1, kv_offset=64, page_size=16, kv_dtype=bf16, scale=d**-0.5)
    if case == "tree":
        draft = (s((b, t, hkv, d), bf16), s((b, t, hkv, d), bf16), s((b, t, t), jnp.bool_))
        fn = lambda *a: arena_attention(*a, **kw)
        args = (s((b, t, hq, d), bf16), *pages, *draft)
    else:
        fn = lambda *a: paged_attention(*a, kv_heads=hkv, num_splits=splits, **kw)
        args = (s((b, t, hq, d), bf16), *pages, s((b, t), i32))
        grid = _grid(fn, *args)
        assert len(grid) == 3 + (case == "decode" and splits is None), grid
    [(name, ir)] = h200(fn, *args)
    assert name == ("tree_attention_arena" if case == "tree" else "paged_attention_arena")
    for a, c in ((128, keys), (keys, 128)):  # q k^T, then p v
        want = f"tensor<{rows}x{a}xbf16> * tensor<{a}x{c}xbf16> -> tensor<{rows}x{c}xf32>"
        assert want in ir, want


@pytest.mark.parametrize("case, t, rows, keys", [("decode", 1, 16, 128), ("prefill", 512, 64, 64)])
def test_arena_attention_lowers_for_sm90_unified_pages(h200, case, t, rows, keys):
    """A padded unified pool's page at Qwen3.5-35B-A3B dims (3152 tokens: 197 pages of 16,
    enough to hold a recurrent state): the paged kernel lowers for sm_90 with key tiles of the
    default size, ``keys`` a step."""
    s, i32, bf16 = jax.ShapeDtypeStruct, jnp.int32, jnp.bfloat16
    b, hq, hkv, d, mp = 2, 16, 2, 256, 12
    pages = (s((8, 1 << 24), jnp.uint32), s((64, 2), i32), s((b, mp), i32), s((b,), i32))
    kw = dict(layer=1, kv_offset=64, page_size=3152, kv_dtype=bf16, scale=d**-0.5, kv_heads=hkv)
    fn = lambda *a: paged_attention(*a, **kw)
    [(name, ir)] = h200(fn, s((b, t, hq, d), bf16), *pages, s((b, t), i32))
    assert name == "paged_attention_arena"
    for a, c in ((128, keys), (keys, 128)):
        want = f"tensor<{rows}x{a}xbf16> * tensor<{a}x{c}xbf16> -> tensor<{rows}x{c}xf32>"
        assert want in ir, want


def test_arena_attention_small_head_dim_keeps_f32_dots(h200):
    """bf16 at ``D = 16`` (8 words a half): the bf16 dots would contract over 8, which the
    GPU's Triton dot computes wrong (measured on the H200: errors of order 1), so the kernel
    keeps f32 operands there; from ``D = 32`` on it takes bf16 operands; in one key split and
    in two."""
    s, i32, bf16 = jax.ShapeDtypeStruct, jnp.int32, jnp.bfloat16
    for splits in (1, 2):
        for d, dot in ((16, "xf32> * tensor<8x"), (32, "xbf16> * tensor<16x")):
            pages = (s((8, 1 << 16), jnp.uint32), s((64, 2), i32), s((2, 8), i32), s((2,), i32))
            kw = dict(layer=1, kv_offset=64, page_size=16, kv_dtype=bf16, scale=d**-0.5)
            kw.update(kv_heads=2, num_splits=splits)
            fn = lambda *a, kw=kw: paged_attention(*a, **kw)
            [(_, ir)] = h200(fn, s((2, 1, 4, d), bf16), *pages, s((2, 1), i32))
            assert dot in ir, (d, dot, splits)


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
