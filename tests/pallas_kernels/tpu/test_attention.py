"""The TPU paged attention over the arena (:func:`pallas_kernels.tpu.paged_attention_arena`,
TPU interpret mode) against float64 attention over the same pages, decode and prefill rows,
f32 and bf16 caches, grouped heads; recycled pages full of random bits (NaN patterns included)
past ``kv_len``; a padding row."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.tpu import paged_attention_arena

LANES = 128


def _scene(rng, dtype, *, b, t, hq, hkv, s, layers, layer, lens, q_pos, hole=False):
    """A random arena (every word random bits), KV units for each row's pages holding random
    K/V values at the committed positions, the table, page handles and the float64 K/V.
    ``hole``: row 0's second page unmapped (handle -1: zero K/V, as the XLA path gathers it)."""
    parts = 1 if dtype == np.float32 else 2
    d = LANES * parts
    kv_offset = 2 * LANES
    block = s * hkv * LANES  # words of one (layer, K or V) block
    unit = kv_offset + layers * 2 * block
    mp = max(-(-n // s) for n in lens) + 1  # one unmapped page past the longest row
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
        rng, dtype, b=b, t=t, hq=hq, hkv=hkv, s=s, layers=2, layer=1, lens=lens, q_pos=q_pos,
        hole=hole,
    )  # fmt: skip
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
