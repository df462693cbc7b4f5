"""The residual add and RMSNorm kernel (interpret mode) against float64, and in the model's
step functions against the XLA path."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from gdn_jax.models import init_random, steps
from gdn_jax.models.cache import init_cache
from gdn_jax.models.norm import RMSNorm, add_rms_norm
from pallas_kernels.norm import add_rms_norm as kernel
from tests.gdn_jax.models.test_create import TINY_MOE


def norm64(x, d, w, eps):
    """``(s, y)`` in float64 from the inputs as given; ``s`` rounded to x's dtype first, as the
    kernel and XLA store it."""
    s = np.asarray(x, np.float64) + (0.0 if d is None else np.asarray(d, np.float64))
    s = np.asarray(jnp.asarray(s, x.dtype), np.float64)
    y = s / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + eps)
    return s, y * (1.0 + np.asarray(w, np.float64))


@settings(deadline=None, max_examples=12)
@given(
    m=st.integers(1, 5),
    h=st.sampled_from([16, 48, 100, 256]),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    added=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_kernel_matches_float64(m, h, dtype, added, seed):
    """Random rows (non-power-of-two widths masked), with and without the residual add: the
    sum exact in x's dtype, the norm to the output's rounding."""
    k = jax.random.split(jax.random.key(seed), 3)
    x = (3.0 * jax.random.normal(k[0], (m, h))).astype(dtype)
    d = jax.random.normal(k[1], (m, h)).astype(dtype) if added else None
    w = (0.2 * jax.random.normal(k[2], (h,))).astype(dtype)
    out = kernel(x, d, w, eps=1e-6, interpret=True)
    s, y = out if added else (x, out)
    chex.assert_shape([s, y], (m, h))
    chex.assert_type([s, y], dtype)
    s64, y64 = norm64(x, d, w, 1e-6)
    np.testing.assert_array_equal(np.asarray(s, np.float64), s64)
    tol = 2e-6 if dtype == jnp.float32 else 8e-3
    assert np.abs(np.asarray(y, np.float64) - y64).max() <= tol * np.abs(y64).max()


def test_pallas_equals_xla_path():
    """``add_rms_norm(impl="pallas")`` gives the XLA path's values over a ``[B, T, H]`` stream
    (bf16: identical; the same f32 arithmetic), and a mismatched ``delta`` is refused."""
    k = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(k[0], (2, 3, 64)).astype(jnp.bfloat16)
    d = jax.random.normal(k[1], (2, 3, 64)).astype(jnp.bfloat16)
    w = (0.1 * jax.random.normal(k[2], (64,))).astype(jnp.bfloat16)
    for delta in (d, None):
        got = add_rms_norm(x, delta, w, eps=1e-6, impl="pallas")
        want = add_rms_norm(x, delta, w, eps=1e-6, impl="xla")
        for g, e in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(e, np.float32))
    with pytest.raises(ValueError, match="delta"):
        add_rms_norm(x, d[:, :2], w, eps=1e-6, impl="pallas")


@pytest.mark.parametrize(
    "args, name",
    [
        ((jnp.ones((2, 3, 8)), None, jnp.ones(8)), "x"),
        ((jnp.ones((2, 8), jnp.int32), None, jnp.ones(8)), "x"),
        ((jnp.ones((2, 8)), jnp.ones((2, 4)), jnp.ones(8)), "delta"),
        ((jnp.ones((2, 8)), None, jnp.ones(4)), "weight"),
    ],
)
def test_bad_inputs_raise(args, name):
    with pytest.raises(ValueError, match=name):
        kernel(*args, eps=1e-6, interpret=True)


DECODE = nnx.jit(steps.decode)


def test_decode_with_the_norm_kernel_matches_xla():
    """A decode step of the tiny MoE model (bf16) with every norm on the kernel (interpret
    mode) gives the XLA path's logits to bf16 rounding (XLA keeps the residual sum in f32
    inside its fusions where the kernel rounds it to bf16, as the model's dtype says)."""
    model = init_random(TINY_MOE, jnp.bfloat16, seed=3)
    norms = [m for _, m in nnx.iter_graph(model) if isinstance(m, RMSNorm)]
    assert len(norms) >= 2 * len(model.layers) + 1
    ids = jnp.asarray(np.random.default_rng(3).integers(0, 64, (2,)), jnp.int32)

    def run(impl):
        for m in norms:
            m.impl = impl
        cache = init_cache(model.config, 2, max_len=8, page_size=4, dtype=jnp.bfloat16)
        logits, _ = DECODE(model, ids, cache)
        return np.asarray(logits, np.float32)

    got, want = run("pallas"), run("xla")
    assert np.isfinite(got).all() and np.abs(want).max() > 0
    assert np.abs(got - want).max() <= 3e-2 * np.abs(want).max()
    assert not np.array_equal(got, want)  # the kernel ran: not XLA's bits
