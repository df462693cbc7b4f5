"""Paged tree attention kernel (interpret mode) against the XLA reference in gdn_jax.models."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn_jax import ancestor_closure
from gdn_jax.models.tree_attention import paged_attention
from pallas_kernels.attention.kernel import tree_attention


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize(
    "n, lengths, dtype",
    [(8, (13, 0), jnp.float32), (5, (16, 3), jnp.float32), (8, (7, 9), jnp.bfloat16)],
)
def test_matches_reference(n, lengths, dtype):
    rng = np.random.default_rng(n)
    b, hq, hkv, d, s, mp = 2, 4, 2, 16, 4, 6
    pages = b * mp + 1
    parents = np.stack([[-1] + [int(rng.integers(-1, i)) for i in range(1, n)] for _ in range(b)])
    parents[1, -1] = -2  # a padding node
    incl = ancestor_closure(jnp.asarray(parents, jnp.int32))
    kv_len = jnp.asarray(lengths, jnp.int32)
    depth = jnp.sum(incl, axis=-1) - 1
    table = rng.permutation(pages)[: b * mp].reshape(b, mp).astype(np.int32)
    r = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
    q, dk, dv = r(b, n, hq, d), r(b, n, hkv, d), r(b, n, hkv, d)
    kp, vp = r(pages, s, hkv, d), r(pages, s, hkv, d)
    want = paged_attention(
        q,
        kp,
        vp,
        jnp.asarray(table),
        kv_len,
        kv_len[:, None] + depth,
        scale=d**-0.5,
        draft_k=dk,
        draft_v=dv,
        draft_mask=incl,
    )
    got = tree_attention(
        q, kp, vp, jnp.asarray(table), kv_len, dk, dv, incl, scale=d**-0.5, interpret=True
    )
    assert got.shape == want.shape and got.dtype == dtype
    real = np.asarray(parents) != -2
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    assert rel_err(np.asarray(got, np.float32)[real], np.asarray(want, np.float32)[real]) < tol
    assert np.isfinite(np.asarray(got, np.float32)).all()


def test_jits():
    b, n, hq, hkv, d, s = 1, 4, 2, 1, 16, 4
    z = lambda *shape: jnp.ones(shape, jnp.float32)
    f = jax.jit(lambda *a: tree_attention(*a, scale=0.25, interpret=True))
    out = f(
        z(b, n, hq, d),
        z(3, s, hkv, d),
        z(3, s, hkv, d),
        jnp.zeros((b, 3), jnp.int32),
        jnp.asarray([5], jnp.int32),
        z(b, n, hkv, d),
        z(b, n, hkv, d),
        jnp.eye(n, dtype=bool)[None],
    )
    np.testing.assert_allclose(out, 1.0, rtol=1e-6)
