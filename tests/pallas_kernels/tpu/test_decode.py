"""The TPU decode kernels (``pallas_kernels.tpu.decode``) in TPU interpret mode: one token and
a short run of tokens against the float64 recurrence; the in-place arena step (a padding row,
a fresh row from zeros) bit for bit the dense step; and the Mosaic lowering."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import tpu
from tests.gdn_jax.reference import recurrent64, rel_err
from tests.gdn_jax.strategies import make_inputs
from tests.pallas_kernels.tpu.common import (
    F32_TOL,
    HK,
    HV,
    OFFSET,
    K,
    V,
    arena_operands,
    arena_shapes,
    arena_with,
    assert_arena_states,
    lowers,
    shapes,
)


@pytest.mark.parametrize("t", [1, 3])
def test_matches_float64(t):
    rng = np.random.default_rng(t)
    q, k, v, g, beta, s0 = make_inputs(rng, 2, t, 1, 2, 16, 32, decay="mixed")
    o, s = tpu.recurrent(
        *(jnp.asarray(x) for x in (q, k, v, g, beta, s0)), use_qk_l2norm=True, interpret=True
    )
    o64, s64 = recurrent64(q, k, v, g, beta, s0, use_qk_l2norm=True)
    assert rel_err(o, o64) < F32_TOL and rel_err(s, s64) < F32_TOL


def test_arena_step_in_place():
    rng = np.random.default_rng(6)
    q, k, v, g, beta, _ = make_inputs(rng, 3, 1, HK, HV, K, V)
    q, k, v, g, beta = (jnp.asarray(x[:, 0]) for x in (q, k, v, g, beta))
    arena, dense = arena_with(rng.standard_normal((3, HV, K, V)), rng)
    fresh = np.array([False, False, True])
    dense[fresh] = 0.0
    o, out = tpu.recurrent_step_arena(
        q, k, v, g, beta, *arena_operands(arena),
        state_offset=OFFSET, use_qk_l2norm=True, zero_state=jnp.asarray(fresh), interpret=True,
    )  # fmt: skip
    o_d, s_d = tpu.recurrent_step(
        q, k, v, g, beta, jnp.asarray(dense), use_qk_l2norm=True, interpret=True
    )
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_d))
    assert_arena_states(out, arena, s_d)


def test_lowers():
    b, hk, hv, d = 4, 2, 4, 128
    bf, f = jnp.bfloat16, jnp.float32
    one = shapes(((b, hk, d), bf), ((b, hk, d), bf), ((b, hv, d), bf), ((b, hv), f), ((b, hv), f))
    assert lowers(
        lambda *a: tpu.recurrent_step(*a, use_qk_l2norm=True), *one, *shapes(((b, hv, d, d), f))
    )
    fn = lambda *a: tpu.recurrent_step_arena(*a, state_offset=128)
    assert lowers(fn, *one, *arena_shapes(b))
