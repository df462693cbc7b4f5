"""The TPU kernels' shared dots (``pallas_kernels.tpu._common``): bf16 pieces and a dot whose
pieces of ``b`` share one MXU pass on a wide MXU, against float64."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.tpu import _common


def _dots(fn, *args) -> int:
    return str(jax.make_jaxpr(fn)(*args)).count("dot_general")


@pytest.mark.parametrize("precision, pieces", [("bf16", 1), ("bf16x3", 2), ("bf16x6", 3)])
def test_split_pieces(precision, pieces):
    x = np.random.default_rng(0).standard_normal((16, 128)).astype(np.float32)
    got = _common.split(jnp.asarray(x), precision)
    assert len(got) == pieces and all(p.dtype == jnp.bfloat16 for p in got)
    total = sum(np.asarray(p, np.float64) for p in got)
    assert np.max(np.abs(total - x) / np.abs(x)) < 2.0 ** (-8 * pieces)


@pytest.mark.parametrize("n, mxu, passes", [(128, 128, 3), (128, 256, 2), (64, 256, 3)])
def test_dot_pieces_side_by_side(n, mxu, passes):
    """At bf16x3 a dot is three products; where ``n`` is a multiple of 128 below the MXU's
    width, the two pieces of ``b`` meeting ``a``'s high piece go in one dot: two passes, the
    same values."""
    rng = np.random.default_rng(1)
    a = jnp.asarray(rng.standard_normal((24, 64)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((64, n)), jnp.float32)
    fn = lambda x, y: _common.dot(x, y, "bf16x3", mxu=mxu)
    assert _dots(fn, a, b) == passes
    got = np.asarray(fn(a, b))
    want = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < 1e-5
    np.testing.assert_allclose(got, np.asarray(_common.dot(a, b, "bf16x3")), rtol=0, atol=1e-6)
