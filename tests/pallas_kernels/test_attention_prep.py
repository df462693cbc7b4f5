"""``pallas_kernels.attention.prep.attention_decode_prep`` (interpret mode): an attention layer's
decode step between its fused projection and its attention, against the model's own functions
(:class:`gdn_jax.models.norm.RMSNorm`'s math, :func:`gdn_jax.models.rope.apply_rope`) and the
arena's word layout: the queries, the K/V words written at each row's page slot (bf16 pairs
packed, or f32 words), nothing written for an invalid row, a position past the page table or
an unmapped page, every other word unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn_jax.models.rope import apply_rope
from pallas_kernels.attention.prep import attention_decode_prep

HQ, HKV, D, R, S, MP, LAYERS = 4, 2, 32, 8, 16, 3, 2
THETA, EPS = 10000.0, 1e-6


def _norm(x, w):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + EPS)
    return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def _case(dtype, kv_dtype, gated, seed=0):
    rng = np.random.default_rng(seed)
    b = 5
    width = HQ * D * (2 if gated else 1) + 2 * HKV * D
    proj = jnp.asarray(rng.normal(size=(b, width)) * 2.0, dtype)
    qn = jnp.asarray(rng.normal(size=(D,)) * 0.3, dtype)
    kn = jnp.asarray(rng.normal(size=(D,)) * 0.3, dtype)
    # rows: a mapped page, a later page, invalid, past the page table, an unmapped page
    positions = jnp.asarray([5, 37, 3, S * MP + 1, 20], jnp.int32)
    valid = jnp.asarray([1, 1, 0, 1, 1], jnp.int32)
    words_per_tok = HKV * D // (2 if jnp.dtype(kv_dtype).itemsize == 2 else 1)
    unit = 2 * LAYERS * S * words_per_tok
    kv_offset = 8
    handles_n = 6
    table = np.stack(
        [np.arange(handles_n) % 2, 8 + kv_offset + (np.arange(handles_n) // 2) * (unit + 40)], 1
    )
    arena = rng.integers(0, 2**32, (2, 8 + kv_offset + 3 * (unit + 40)), dtype=np.uint64).astype(
        np.uint32
    )
    pages = np.array([[0, 1, -1], [2, 3, 4], [5, -1, -1], [1, 2, 3], [4, -1, -1]], np.int32)
    return (
        proj,
        qn,
        kn,
        positions,
        valid,
        arena,
        table.astype(np.int32),
        pages,
        kv_offset,
        words_per_tok,
    )


def _reference(
    proj, qn, kn, positions, valid, arena, table, pages, kv_offset, wpt, *, kv_dtype, gated, layer
):
    """The XLA path's queries and arena (the model's norm and rope, then the K/V words)."""
    b = proj.shape[0]
    qw = D * (2 if gated else 1)
    q = proj[:, : HQ * qw].reshape(b, 1, HQ, qw)[..., :D]
    k = proj[:, HQ * qw : HQ * qw + HKV * D].reshape(b, 1, HKV, D)
    v = proj[:, HQ * qw + HKV * D :].reshape(b, 1, HKV, D)
    pos = positions[:, None]
    q = apply_rope(_norm(q, qn), pos, rotary_dim=R, theta=THETA)[:, 0]
    k = apply_rope(_norm(k, kn), pos, rotary_dim=R, theta=THETA)[:, 0]
    out = arena.copy()
    for i in range(b):
        p = int(positions[i])
        page = p // S
        if not valid[i] or page >= MP or pages[i, page] < 0:
            continue
        seg, word = table[pages[i, page]]
        row = word + kv_offset + (p % S) * wpt
        for blk, x in ((2 * layer, k[i]), (2 * layer + 1, v[i, 0])):
            vals = np.asarray(x.reshape(-1).astype(kv_dtype))
            words = (
                vals.view(np.uint32)
                if vals.dtype.itemsize == 4
                else vals.view(np.uint16).view(np.uint32)
            )
            start = row + blk * S * wpt
            out[seg, start : start + wpt] = words
    return np.asarray(q), out


def _decode(words, kv_dtype):
    if jnp.dtype(kv_dtype).itemsize == 4:
        return words.view(np.float32)
    return words.view(np.uint16).view(jnp.bfloat16).astype(np.float32)


@pytest.mark.parametrize(
    "dtype, kv_dtype, gated",
    [
        (jnp.bfloat16, jnp.bfloat16, True),
        (jnp.bfloat16, jnp.float32, False),
        (jnp.float32, jnp.float32, True),
        (jnp.float32, jnp.bfloat16, True),
    ],
)
def test_prep_matches_the_model_and_the_arena_layout(dtype, kv_dtype, gated):
    proj, qn, kn, positions, valid, arena, table, pages, kv_offset, wpt = _case(
        dtype, kv_dtype, gated
    )
    layer = 1
    q, out = attention_decode_prep(
        proj, qn, kn, positions, valid, jnp.asarray(arena), jnp.asarray(table), jnp.asarray(pages),
        num_heads=HQ, kv_heads=HKV, head_dim=D, rotary_dim=R, theta=THETA, eps=EPS, gated=gated,
        layer=layer, kv_offset=kv_offset, page_size=S, kv_dtype=jnp.dtype(kv_dtype).name,
        interpret=True,
    )  # fmt: skip
    q_ref, out_ref = _reference(
        proj, qn, kn, np.asarray(positions), np.asarray(valid), arena, table, pages, kv_offset,
        wpt, kv_dtype=kv_dtype, gated=gated, layer=layer,
    )  # fmt: skip
    assert q.shape == (5, HQ, D) and q.dtype == dtype
    tol = 1e-5 if dtype == jnp.float32 else 1.6e-2  # one bf16 rounding apart at most
    q32, qr32 = np.asarray(q, np.float32), q_ref.astype(np.float32)
    np.testing.assert_allclose(q32, qr32, rtol=tol, atol=tol * np.abs(qr32).max())
    out = np.asarray(out)
    written = out_ref != arena
    assert written.any()
    np.testing.assert_array_equal(out[~written], arena[~written])  # nothing else touched
    got, want = _decode(out[written], kv_dtype), _decode(out_ref[written], kv_dtype)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(rotary_dim=7), "^rotary_dim: an even number"),
        (dict(head_dim=24), "^head_dim: a power of two"),
        (
            dict(num_heads=3),
            r"^proj: expected 320 columns \(Hq 3 x D 32 x 2 \(gated\) \+ 2 x Hkv 2 x D\), got 384",
        ),
        (dict(kv_dtype="float16"), "^kv_dtype: float32 or bfloat16"),
    ],
)
def test_prep_checks(change, match):
    proj, qn, kn, positions, valid, arena, table, pages, kv_offset, _ = _case(
        jnp.float32, jnp.float32, True
    )
    kw = dict(
        num_heads=HQ, kv_heads=HKV, head_dim=D, rotary_dim=R, theta=THETA, eps=EPS, gated=True,
        layer=0, kv_offset=kv_offset, page_size=S, kv_dtype="float32", interpret=True,
    )  # fmt: skip
    kw.update(change)
    with pytest.raises(ValueError, match=match):
        attention_decode_prep(
            proj,
            qn,
            kn,
            positions,
            valid,
            jnp.asarray(arena),
            jnp.asarray(table),
            jnp.asarray(pages),
            **kw,
        )
