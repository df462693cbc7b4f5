"""Recurrent and chunked gated delta rule against the float64 token recurrence."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gdn_jax import chunk_gated_delta_rule, recurrent_gated_delta_rule
from tests.gdn_jax.reference import recurrent64, rel_err
from tests.gdn_jax.strategies import head_shapes, make_inputs


@settings(max_examples=25, deadline=None)
@given(
    t=st.sampled_from([1, 5, 16, 50]),
    shapes=head_shapes(),
    decay=st.sampled_from(["mild", "strong", "mixed"]),
    dtype=st.sampled_from([np.float32, jnp.bfloat16]),
    l2=st.booleans(),
    with_state=st.booleans(),
    chunk=st.sampled_from([8, 64]),
    seed=st.integers(0, 2**31 - 1),
)
def test_recurrent_and_chunk_match_float64(t, shapes, decay, dtype, l2, with_state, chunk, seed):
    hk, hv, dk, dv = shapes
    q, k, v, g, beta, s0 = make_inputs(
        np.random.default_rng(seed), 2, t, hk, hv, dk, dv, decay=decay, dtype=dtype
    )
    s0 = s0 if with_state else None
    o64, s64 = recurrent64(q, k, v, g, beta, s0, use_qk_l2norm=l2)
    tol = 2e-4 if dtype == np.float32 else 1e-2
    for o, s in (
        recurrent_gated_delta_rule(q, k, v, g, beta, s0, use_qk_l2norm=l2),
        chunk_gated_delta_rule(q, k, v, g, beta, s0, use_qk_l2norm=l2, chunk_size=chunk),
    ):
        chex.assert_shape(o, (2, t, hv, dv))
        chex.assert_type(o, dtype)
        chex.assert_type(s, jnp.float32)
        chex.assert_tree_all_finite((o, s))
        assert rel_err(o, o64) < tol
        assert rel_err(s, s64) < 2e-4


@settings(max_examples=15, deadline=None)
@given(
    lens=st.lists(st.integers(0, 40), min_size=1, max_size=5).filter(lambda x: sum(x) > 0),
    chunk=st.sampled_from([8, 16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_cu_seqlens_equals_separate_sequences(lens, chunk, seed):
    """Packed variable-length sequences (including empty ones) equal running each alone."""
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    t, n_seq = int(cu[-1]), len(lens)
    rng = np.random.default_rng(seed)
    q, k, v, g, beta, _ = make_inputs(rng, 1, t, 1, 2, 4, 6, decay="mixed")
    h0 = rng.normal(size=(n_seq, 2, 4, 6)).astype(np.float32)
    o, s = chunk_gated_delta_rule(
        q, k, v, g, beta, h0, cu_seqlens=cu, chunk_size=chunk, use_qk_l2norm=True
    )
    chex.assert_shape(s, (n_seq, 2, 4, 6))
    for i in range(n_seq):
        a, b = cu[i], cu[i + 1]
        if a == b:
            np.testing.assert_array_equal(s[i], h0[i])
            continue
        o64, s64 = recurrent64(
            q[:, a:b],
            k[:, a:b],
            v[:, a:b],
            g[:, a:b],
            beta[:, a:b],
            h0[i : i + 1],
            use_qk_l2norm=True,
        )
        assert rel_err(o[:, a:b], o64) < 2e-4
        assert rel_err(s[i], s64[0]) < 2e-4


def test_cu_seqlens_traced_under_jit():
    """The packed layout is computed on device: cu_seqlens may be traced (one program)."""
    rng = np.random.default_rng(0)
    q, k, v, g, beta, _ = make_inputs(rng, 1, 24, 1, 1, 4, 4)
    f = jax.jit(lambda cu: chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, chunk_size=8))
    for cu in ([0, 10, 24, 24], [0, 1, 2, 24], [0, 24, 24, 24]):
        cu = np.array(cu, np.int32)
        o, s = f(cu)
        o_ref, s_ref = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, chunk_size=8)
        np.testing.assert_allclose(o, o_ref, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(s, s_ref, rtol=1e-6, atol=1e-6)
    assert f._cache_size() == 1


def test_output_final_state_false_and_vmap():
    rng = np.random.default_rng(1)
    q, k, v, g, beta, s0 = make_inputs(rng, 3, 9, 1, 2, 4, 4)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, s0, output_final_state=False)
    assert s is None
    one = lambda *xs: recurrent_gated_delta_rule(*(x[None] for x in xs))[0][0]
    np.testing.assert_allclose(jax.vmap(one)(q, k, v, g, beta, s0), o, rtol=2e-5, atol=2e-5)


def test_errors():
    rng = np.random.default_rng(2)
    q, k, v, g, beta, s0 = make_inputs(rng, 2, 8, 2, 4, 4, 4)
    for fn in (recurrent_gated_delta_rule, chunk_gated_delta_rule):
        with pytest.raises(ValueError, match="multiple of key heads"):
            fn(q, k, v[:, :, :3], g[..., :3], beta[..., :3])
        with pytest.raises(ValueError, match="^k: expected rank 4"):
            fn(q[0], k[0], v, g, beta)
        with pytest.raises(ValueError, match="^initial_state: "):
            fn(q, k, v, g, beta, s0[:1])
        with pytest.raises(ValueError, match="^v: "):
            fn(q, k, v[:1], g, beta)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=0)
    with pytest.raises(ValueError, match="batch size 1"):
        chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=np.array([0, 8]))
    with pytest.raises(ValueError, match="end at T=8"):
        chunk_gated_delta_rule(q[:1], k[:1], v[:1], g[:1], beta[:1], cu_seqlens=np.array([0, 5]))
    with pytest.raises(ValueError, match="non-decreasing"):
        chunk_gated_delta_rule(
            q[:1], k[:1], v[:1], g[:1], beta[:1], cu_seqlens=np.array([0, 6, 5, 8])
        )
    with pytest.raises(ValueError, match=r"^initial_state: .* = \(2, 4, 4, 4\)"):
        chunk_gated_delta_rule(
            q[:1], k[:1], v[:1], g[:1], beta[:1], s0[:1], cu_seqlens=np.array([0, 5, 8])
        )
    with pytest.raises(ValueError, match="impl"):
        chunk_gated_delta_rule(q, k, v, g, beta, impl="triton")
    with pytest.raises(ValueError, match="no Pallas kernel|impl"):
        from gdn_jax.dispatch import PALLAS_OPS, resolve_impl

        if "missing_op" not in PALLAS_OPS:
            resolve_impl("pallas", "missing_op")
