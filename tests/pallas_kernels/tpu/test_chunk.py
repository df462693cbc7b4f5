"""The TPU chunked prefill (``pallas_kernels.tpu.chunk``) in TPU interpret mode: packed
sequences (one empty, one spanning several chunks, one ending mid-chunk) and a batch, against
the float64 recurrence; the chunk-size check; and the Mosaic lowering at chunks of 64 and 128."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import tpu
from tests.gdn_jax.reference import recurrent64, rel_err
from tests.gdn_jax.strategies import make_inputs
from tests.pallas_kernels.tpu.common import BF16_O_TOL, F32_TOL, lowers, shapes


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_packed_sequences(dtype):
    rng = np.random.default_rng(4)
    cu = np.array([0, 5, 5, 40], np.int32)
    q, k, v, g, beta, _ = make_inputs(rng, 1, 40, 1, 2, 16, 32, decay="mixed")
    h0 = rng.normal(size=(3, 2, 16, 32)).astype(np.float32)
    cast = [jnp.asarray(x, dtype) for x in (q, k, v)]
    o, fin = tpu.chunk_gated_delta_rule(
        *cast, jnp.asarray(g), jnp.asarray(beta), jnp.asarray(h0), use_qk_l2norm=True,
        chunk_size=16, cu_seqlens=jnp.asarray(cu), interpret=True,
    )  # fmt: skip
    assert o.dtype == cast[2].dtype and fin.shape == h0.shape
    f = [np.asarray(x, np.float32) for x in cast]
    o_tol = F32_TOL if dtype == np.float32 else BF16_O_TOL
    for i in range(3):
        a, e = cu[i], cu[i + 1]
        o64, s64 = recurrent64(
            *(x[:, a:e] for x in (*f, g, beta)), h0[i : i + 1], use_qk_l2norm=True
        )
        if e > a:
            assert rel_err(np.asarray(o, np.float32)[:, a:e], o64) < o_tol
        assert rel_err(fin[i : i + 1], s64) < F32_TOL


def test_batch_without_final_state():
    rng = np.random.default_rng(5)
    q, k, v, g, beta, s0 = make_inputs(rng, 2, 20, 1, 2, 16, 16, decay="strong")
    args = [jnp.asarray(x) for x in (q, k, v, g, beta, s0)]
    o, fin = tpu.chunk_gated_delta_rule(
        *args, chunk_size=16, output_final_state=False, interpret=True
    )
    o64, _ = recurrent64(q, k, v, g, beta, s0)
    assert fin is None and rel_err(o, o64) < F32_TOL
    with pytest.raises(ValueError, match="chunk_size"):
        tpu.chunk_gated_delta_rule(*args, chunk_size=48, interpret=True)


@pytest.mark.parametrize("chunk", [64, 128])
def test_lowers(chunk):
    t, hk, hv, d = 300, 2, 4, 128
    bf, f = jnp.bfloat16, jnp.float32
    args = shapes(
        ((1, t, hk, d), bf),
        ((1, t, hk, d), bf),
        ((1, t, hv, d), bf),
        ((1, t, hv), f),
        ((1, t, hv), f),
        ((3, hv, d, d), f),
        ((4,), jnp.int32),
    )

    def fn(q, k, v, g, beta, h0, cu):
        return tpu.chunk_gated_delta_rule(
            q, k, v, g, beta, h0, cu_seqlens=cu, chunk_size=chunk, use_qk_l2norm=True
        )

    assert lowers(fn, *args)
