"""The TPU attention kernels over the arena in TPU interpret mode: the paged attention
(:func:`pallas_kernels.tpu.paged_attention_arena`; decode and prefill rows, a padding row,
rows over several steps of the page loop) and the tree attention
(:func:`pallas_kernels.tpu.tree_attention_arena`; random chains, stars, forests and padded
trees, ``kv_len`` 0 and off page boundaries) against float64 attention over the same pages and
the XLA path; f32 and bf16 caches, grouped heads; recycled pages full of random bits (NaN
patterns included) past ``kv_len``, an unmapped page below it; the input checks and the Mosaic
lowering at Qwen3.5's geometry."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gdn_jax.models.tree_attention import attend_committed
from pallas_kernels.tpu import paged_attention_arena, tree_attention_arena, tree_attention_vmem
from tests.gdn_jax.reference import rel_err
from tests.gdn_jax.strategies import make_tree

LANES = 128


def _scene(rng, dtype, *, b, hkv, s, layers, layer, lens, hole=False, mp=None):
    """A random arena (every word random bits), KV units for each row's pages holding random
    K/V values at the committed positions, the table, page handles and the float64 K/V.
    ``hole``: row 0's second page unmapped (handle -1: zero K/V, as the XLA path gathers it).
    ``mp``: pages per row in the table (default: one unmapped page past the longest row)."""
    parts = 1 if dtype == np.float32 else 2
    d = LANES * parts
    kv_offset = 2 * LANES
    block = s * hkv * LANES  # words of one (layer, K or V) block
    unit = kv_offset + layers * 2 * block
    mp = mp or max(-(-n // s) for n in lens) + 1
    units = b * mp
    seg_words = 4 * unit
    nseg = -(-units // 4)
    arena = rng.integers(0, 2**32, (nseg, seg_words), dtype=np.uint64).astype(np.uint32)
    table = np.full((units + 3, 2), -1, np.int32)
    handles = np.full((b, mp), -1, np.int32)
    perm = rng.permutation(units)  # pages scattered over segments and slots
    k64 = np.zeros((b, mp * s, hkv, d))
    v64 = np.zeros((b, mp * s, hkv, d))
    for i in range(b):
        for j in range(-(-lens[i] // s)):
            h = int(perm[i * mp + j]) + 3  # handles are not slot numbers
            slot = h - 3
            table[h] = (slot // 4, (slot % 4) * unit)
            handles[i, j] = h
            for kv, out in ((0, k64), (1, v64)):
                vals = rng.standard_normal((s, hkv, d)).astype(dtype)
                out[i, j * s : (j + 1) * s] = vals.astype(np.float64)
                words = np.frombuffer(vals.tobytes(), np.uint32).copy()
                stale = max(lens[i] - j * s, 0) * hkv * LANES  # the committed words
                words[stale:] = 0x7FC00000  # past kv_len: a recycled page's NaN bits
                start = table[h, 1] + kv_offset + (layer * 2 + kv) * block
                arena[table[h, 0], start : start + block] = words
    if hole:
        assert lens[0] > 2 * s
        handles[0, 1] = -1
        k64[0, s : 2 * s] = v64[0, s : 2 * s] = 0.0
    return arena, table, handles, k64, v64, kv_offset


def _reference(q, k64, v64, lens, q_pos, scale):
    b, t, hq, d = q.shape
    hkv = k64.shape[2]
    out = np.zeros((b, t, hq, d))
    for i in range(b):
        for tt in range(t):
            keys = [j for j in range(lens[i]) if j <= q_pos[i, tt]]
            if not keys:
                continue  # a padding row: zeros
            for h in range(hq):
                kh = h // (hq // hkv)
                sc = k64[i, keys, kh] @ q[i, tt, h].astype(np.float64) * scale
                p = np.exp(sc - sc.max())
                out[i, tt, h] = (p / p.sum()) @ v64[i, keys, kh]
    return out


@pytest.mark.parametrize(
    "dtype, t, lens, hq, hkv, s, hole",
    [
        (np.float32, 1, [13, 0, 5], 4, 2, 8, False),  # decode, a padding row
        (np.float32, 3, [11, 3], 2, 1, 4, True),  # a prefill chunk; an unmapped page
        (ml_dtypes.bfloat16, 1, [9, 17], 4, 1, 8, False),
        (ml_dtypes.bfloat16, 2, [10, 12], 2, 2, 4, True),
    ],
)
def test_paged_attention_arena_matches_float64(dtype, t, lens, hq, hkv, s, hole):
    rng = np.random.default_rng(len(lens) * 100 + t * 10 + hq)
    b = len(lens)
    # queries at the last t positions of each row (a row of length 0 is padding)
    q_pos = np.array([[max(n - t + i, 0) for i in range(t)] for n in lens], np.int32)
    arena, table, handles, k64, v64, kv_offset = _scene(
        rng, dtype, b=b, hkv=hkv, s=s, layers=2, layer=1, lens=lens, hole=hole
    )
    d = k64.shape[-1]
    q = rng.standard_normal((b, t, hq, d)).astype(dtype)
    scale = d**-0.5
    got = paged_attention_arena(
        jnp.asarray(q),
        arena=jnp.asarray(arena),
        table=jnp.asarray(table),
        page_handles=jnp.asarray(handles),
        layer=1,
        kv_offset=kv_offset,
        page_size=s,
        kv_dtype=jnp.dtype(dtype),
        kv_len=jnp.asarray(lens, jnp.int32),
        q_pos=jnp.asarray(q_pos),
        kv_heads=hkv,
        scale=scale,
        interpret=True,
    )
    assert got.shape == q.shape and got.dtype == q.dtype
    want = _reference(q, k64, v64, lens, q_pos, scale)
    tol = 1e-5 if dtype == np.float32 else 1e-2  # bf16: the output rounded to bf16
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=tol, rtol=tol)
    assert np.all(np.isfinite(np.asarray(got, np.float64)))


def test_paged_attention_arena_many_steps():
    """Rows longer than one step of the page loop (8 pages of 16 tokens a step): the next
    step's pages load while this one is computed, a step ends mid-table, an unmapped page
    below ``kv_len``, two KV heads read strided from the same pages."""
    rng = np.random.default_rng(7)
    lens, t, hq, hkv, s = [300, 45], 2, 4, 2, 16
    q_pos = np.array([[n - t + i for i in range(t)] for n in lens], np.int32)
    arena, table, handles, k64, v64, kv_offset = _scene(
        rng, np.float32, b=2, hkv=hkv, s=s, layers=2, layer=1, lens=lens, hole=True
    )
    q = rng.standard_normal((2, t, hq, LANES)).astype(np.float32)
    got = paged_attention_arena(
        jnp.asarray(q), arena=jnp.asarray(arena), table=jnp.asarray(table),
        page_handles=jnp.asarray(handles), layer=1, kv_offset=kv_offset, page_size=s,
        kv_dtype=jnp.float32, kv_len=jnp.asarray(lens, jnp.int32), q_pos=jnp.asarray(q_pos),
        kv_heads=hkv, scale=LANES**-0.5, interpret=True,
    )  # fmt: skip
    want = _reference(q, k64, v64, lens, q_pos, LANES**-0.5)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=1e-5, rtol=1e-5)


def test_paged_attention_arena_refuses_misfits():
    q = jnp.zeros((1, 1, 2, 64), jnp.float32)
    kw = dict(
        arena=jnp.zeros((1, 1024), jnp.uint32),
        table=jnp.zeros((4, 2), jnp.int32),
        page_handles=jnp.zeros((1, 2), jnp.int32),
        layer=0,
        kv_offset=0,
        page_size=4,
        kv_dtype=jnp.float32,
        kv_len=jnp.ones((1,), jnp.int32),
        q_pos=jnp.zeros((1, 1), jnp.int32),
        kv_heads=1,
        scale=1.0,
        interpret=True,
    )
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention_arena(q, **kw)
    q = jnp.zeros((1, 1, 2, 128), jnp.float32)
    with pytest.raises(ValueError, match="kv_offset"):
        paged_attention_arena(q, **{**kw, "kv_offset": 64})
    with pytest.raises(ValueError, match="kv_dtype"):
        paged_attention_arena(q, **{**kw, "kv_dtype": jnp.float16})


@pytest.mark.parametrize("t", [1, 16])
def test_paged_attention_arena_lowers_to_mosaic(t):
    """Qwen3.5's full-attention geometry (bf16, head dim 256, 16 query heads on 2 KV heads,
    16-token pages): decode and a 16-token prefill chunk lower to one Mosaic kernel."""
    from jax import ShapeDtypeStruct as S

    from tests.pallas_kernels.tpu.common import lowers

    b, mp = 4, 8

    def fn(q, arena, table, pages, kv_len, q_pos):
        return paged_attention_arena(
            q, arena=arena, table=table, page_handles=pages, layer=1, kv_offset=256,
            page_size=16, kv_dtype=jnp.bfloat16, kv_len=kv_len, q_pos=q_pos, kv_heads=2,
            scale=0.0625,
        )  # fmt: skip

    assert lowers(
        fn,
        S((b, t, 16, 256), jnp.bfloat16),
        S((4, 1 << 16), jnp.uint32),
        S((64, 2), jnp.int32),
        S((b, mp), jnp.int32),
        S((b,), jnp.int32),
        S((b, t), jnp.int32),
    )


# ------------------------------------------------------------------------- tree attention


def _path_mask(parents):
    """bool ``[B, N, N]``: node ``m`` on the root-to-node path of ``n`` (itself included; a
    padding node ``-2`` sees itself only), as ``gdn_jax.tree_wy.ancestor_closure``."""
    b, n = parents.shape
    mask = np.zeros((b, n, n), bool)
    for i in range(b):
        for node in range(n):
            m = node
            while m >= 0:
                mask[i, node, m] = True
                m = parents[i, m] if parents[i, m] >= 0 else -1
    return mask


def _tree_reference(q, k64, v64, lens, dk, dv, mask, scale):
    """float64 softmax of each node over its row's committed keys ``j < kv_len`` and the
    draft keys on its path, one softmax over both."""
    b, n, hq, d = q.shape
    hkv = k64.shape[2]
    out = np.zeros((b, n, hq, d))
    for i in range(b):
        for node in range(n):
            path = np.flatnonzero(mask[i, node])
            for h in range(hq):
                kh = h // (hq // hkv)
                keys = np.concatenate([k64[i, : lens[i], kh], dk[i, path, kh]])
                vals = np.concatenate([v64[i, : lens[i], kh], dv[i, path, kh]])
                sc = keys @ q[i, node, h].astype(np.float64) * scale
                p = np.exp(sc - sc.max())
                out[i, node, h] = (p / p.sum()) @ vals
    return out


def _check_tree(rng, dtype, parents, lens, *, hq, hkv, s, hole=False, mp=None):
    """The TPU tree attention on a fresh random scene against float64 and the XLA path
    (``attend_committed`` over the gathered pages, nodes at ``kv_len + depth - 1``)."""
    b, n = parents.shape
    arena, table, handles, k64, v64, kv_offset = _scene(
        rng, dtype, b=b, hkv=hkv, s=s, layers=2, layer=1, lens=lens, hole=hole, mp=mp
    )
    d = k64.shape[-1]
    q, dk, dv = (rng.standard_normal((b, n, h, d)).astype(dtype) for h in (hq, hkv, hkv))
    mask = _path_mask(parents)
    scale = d**-0.5
    kv_len = jnp.asarray(lens, jnp.int32)
    got = tree_attention_arena(
        jnp.asarray(q), jnp.asarray(arena), jnp.asarray(table), jnp.asarray(handles), kv_len,
        jnp.asarray(dk), jnp.asarray(dv), jnp.asarray(mask),
        layer=1, kv_offset=kv_offset, page_size=s, kv_dtype=jnp.dtype(dtype), scale=scale,
        interpret=True,
    )  # fmt: skip
    assert got.shape == q.shape and got.dtype == q.dtype
    got = np.asarray(got, np.float64)
    assert np.all(np.isfinite(got))
    want = _tree_reference(q, k64, v64, lens, dk.astype(np.float64), dv.astype(np.float64),
                           mask, scale)  # fmt: skip
    q_pos = kv_len[:, None] + jnp.asarray(mask.sum(-1) - 1, jnp.int32)
    xla = attend_committed(
        jnp.asarray(q), jnp.asarray(k64, dtype), jnp.asarray(v64, dtype), kv_len, q_pos,
        scale=scale, draft_k=jnp.asarray(dk), draft_v=jnp.asarray(dv),
        draft_mask=jnp.asarray(mask),
    )  # fmt: skip
    tol = 1e-4 if dtype == np.float32 else 1e-2  # bf16: the output rounded to bf16
    assert rel_err(got, want) < tol
    assert rel_err(got, np.asarray(xla, np.float64)) < tol


@pytest.mark.parametrize(
    "dtype, kinds, lens, hq, hkv, s, hole",
    [
        # kv_len 0 and off a page boundary, grouped heads, an unmapped page below kv_len
        (np.float32, ("forest", "chain"), [0, 13, 11], 4, 2, 4, True),
        (ml_dtypes.bfloat16, ("star", "padded"), [9, 4], 4, 1, 8, False),
    ],
)
def test_tree_attention_arena_matches_float64(dtype, kinds, lens, hq, hkv, s, hole):
    rng = np.random.default_rng(sum(lens) + hq)
    trees = [make_tree(kinds[i % len(kinds)], 5, rng) for i in range(len(lens))]
    if hole:
        lens = [lens[1], lens[0], *lens[2:]]  # row 0 needs two full pages for the hole
    _check_tree(rng, dtype, np.stack(trees), lens, hq=hq, hkv=hkv, s=s, hole=hole)


@settings(max_examples=4, deadline=None)
@given(
    kinds=st.lists(
        st.sampled_from(["chain", "star", "random", "forest", "padded"]), min_size=2, max_size=2
    ),  # fmt: skip
    lens=st.lists(st.integers(0, 19), min_size=2, max_size=2),
    seed=st.integers(0, 2**31 - 1),
)
def test_tree_attention_arena_random_trees(kinds, lens, seed):
    """Random trees of 16 nodes over random committed lengths (one compiled program: the
    shapes stay, the topology and lengths are data)."""
    rng = np.random.default_rng(seed)
    parents = np.stack([make_tree(kind, 16, rng) for kind in kinds])
    _check_tree(rng, np.float32, parents, lens, hq=2, hkv=1, s=4, mp=6)


def test_tree_attention_arena_refuses_misfits():
    b, n = 1, 4
    q = jnp.zeros((b, n, 2, 128), jnp.float32)
    draft = jnp.zeros((b, n, 1, 128), jnp.float32)
    args = (
        jnp.zeros((1, 1024), jnp.uint32), jnp.zeros((4, 2), jnp.int32),
        jnp.zeros((b, 2), jnp.int32), jnp.ones((b,), jnp.int32),
    )  # fmt: skip
    kw = dict(layer=0, kv_offset=0, page_size=4, kv_dtype=jnp.float32, scale=1.0, interpret=True)
    mask = jnp.ones((b, n, n), bool)
    with pytest.raises(ValueError, match="head_dim"):
        tree_attention_arena(q[..., :64], *args, draft[..., :64], draft[..., :64], mask, **kw)
    with pytest.raises(ValueError, match="draft_mask"):
        tree_attention_arena(q, *args, draft, draft, mask[:, :2], **kw)
    with pytest.raises(ValueError, match="draft_v"):
        tree_attention_arena(q, *args, draft, draft[:, :2], mask, **kw)
    with pytest.raises(ValueError, match="query heads"):
        tree_attention_arena(q[:, :, :1], *args, jnp.zeros((b, n, 2, 128)), draft, mask, **kw)
    assert tree_attention_vmem(1024, 64, 1, 16, jnp.bfloat16) > 64 << 20
    big = jnp.zeros((b, 1024, 64, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="VMEM"):
        tree_attention_arena(
            big, *args, big[:, :, :1], big[:, :, :1], jnp.ones((b, 1024, 1024), bool),
            **{**kw, "kv_dtype": jnp.bfloat16, "page_size": 16},
        )  # fmt: skip


@pytest.mark.parametrize("n", [64, 128])
def test_tree_attention_arena_lowers_to_mosaic(n):
    """Qwen3.5's full-attention geometry (bf16, head dim 256, 16 query heads on 2 KV heads,
    16-token pages): trees of 64 and 128 nodes lower to one Mosaic kernel."""
    from jax import ShapeDtypeStruct as S

    from tests.pallas_kernels.tpu.common import lowers

    b, mp = 2, 8

    def fn(q, arena, table, pages, kv_len, dk, dv, mask):
        return tree_attention_arena(
            q, arena, table, pages, kv_len, dk, dv, mask, layer=1, kv_offset=256,
            page_size=16, kv_dtype=jnp.bfloat16, scale=0.0625,
        )  # fmt: skip

    draft = S((b, n, 2, 256), jnp.bfloat16)
    assert lowers(
        fn,
        S((b, n, 16, 256), jnp.bfloat16),
        S((4, 1 << 16), jnp.uint32),
        S((64, 2), jnp.int32),
        S((b, mp), jnp.int32),
        S((b,), jnp.int32),
        draft,
        draft,
        S((b, n, n), jnp.bool_),
    )
