"""The token-by-token arena kernels (``pallas_kernels.decode.arena``, interpret mode):
``recurrent_step`` (one decode token per row) and ``recurrent_prefill`` (T tokens per row,
ragged ``num_tokens``, 0 and T included) on states read from, and written back in place into, a
uint32 arena through a handle table. Both equal ``gdn_jax.recurrent_gated_delta_rule``, a
float64 numpy reference and ``decode/reference.py``; no other arena word changes; padding rows
(handle -1) are never written; fresh rows (``zero_state``) ignore their unit's stale bits and
are written. ``decode/reference.py`` itself is checked against the float64 recurrence."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gdn_jax import recurrent_gated_delta_rule
from pallas_kernels.decode.arena import (
    recurrent_prefill,
    recurrent_step,
    recurrent_step_mixed,
    step_gates,
)
from pallas_kernels.decode.reference import (
    recurrent_prefill_arena_reference,
    recurrent_prefill_reference,
    recurrent_step_arena_reference,
    recurrent_step_reference,
)
from tests.gdn_jax.reference import prep64, recurrent64, rel_err
from tests.gdn_jax.strategies import head_shapes, make_inputs
from tests.pallas_kernels.common import (
    OFFSET,
    SEGMENTS,
    TABLE,
    WORDS,
    K,
    V,
    place_states,
    read_states,
)

STEP_HANDLES = np.array([2, -1, 0], np.int32)  # row 1 is padding
# rows: a valid row, padding, a fresh row (stale unit), a valid row with num_tokens 0
PREFILL_HANDLES = np.array([2, -1, 0, 4], np.int32)
FRESH = np.array([False, False, True, False])


def _inputs(rng, b, hk, hv, dtype, t=None):
    """Random ``q, k [B, (T,) Hk, K]``, ``v [B, (T,) Hv, V]``, f32 ``g, beta [B, (T,) Hv]``."""
    lead = (b,) if t is None else (b, t)
    cast = lambda x, dt=dtype: jnp.asarray(x, dt)
    q, k = (cast(rng.standard_normal((*lead, hk, K))) for _ in range(2))
    v = cast(rng.standard_normal((*lead, hv, V)))
    g = cast(-rng.uniform(0.01, 0.3, (*lead, hv)), jnp.float32)
    beta = cast(rng.uniform(0.2, 1.0, (*lead, hv)), jnp.float32)
    return q, k, v, g, beta


def _arena(rng, s0, handles, fresh=None):
    """Garbage everywhere (NaN patterns included), each valid row's state at its handle's
    (unaligned) place; a fresh row's unit keeps its garbage."""
    arena = rng.integers(0, 2**32, (SEGMENTS, WORDS), dtype=np.uint32)
    return place_states(arena, TABLE, handles, s0, OFFSET, skip=fresh)


def _states(arena, hv, handles):
    """The valid rows' states in ``arena`` (padding rows: None) and a mask of every other word."""
    return read_states(np.asarray(arena), TABLE, handles, OFFSET, (hv, K, V))


def _addr(arena, handles):
    """``(arena, table, handles)`` as device arrays (a fresh arena buffer: the kernels donate it)."""
    return jnp.asarray(arena), jnp.asarray(TABLE), jnp.asarray(handles)


_KERNEL = dict(state_offset=OFFSET, block_v=16, interpret=True)
_JIT = functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm"), donate_argnums=5)


@_JIT
def _step(q, k, v, g, beta, arena, table, handles, zero_state=None, **kw):
    """``recurrent_step`` (``kw``: ``scale``, ``use_qk_l2norm``), the arena donated."""
    kw = dict(zero_state=zero_state, **_KERNEL, **kw)
    return recurrent_step(q, k, v, g, beta, arena, table, handles, **kw)


@_JIT
def _prefill(q, k, v, g, beta, arena, table, handles, num_tokens, zero_state, **kw):
    """``recurrent_prefill`` (``kw``: ``scale``, ``use_qk_l2norm``), the arena donated."""
    kw = dict(num_tokens=num_tokens, zero_state=zero_state, **_KERNEL, **kw)
    return recurrent_prefill(q, k, v, g, beta, arena, table, handles, **kw)


# ------------------------------------------------------------------------ one decode token


@pytest.mark.parametrize(
    "dtype, hk, hv, l2, scale",
    [
        (np.float32, 1, 2, True, None),
        (jnp.bfloat16, 2, 4, False, None),
        (np.float32, 2, 4, False, 0.3),
    ],
)
def test_step_matches_recurrent_rule(dtype, hk, hv, l2, scale):
    rng = np.random.default_rng(hv + l2)
    b = len(STEP_HANDLES)
    q, k, v, g, beta = _inputs(rng, b, hk, hv, dtype)
    s0 = rng.standard_normal((b, hv, K, V)).astype(np.float32)
    arena = _arena(rng, s0, STEP_HANDLES)
    dense = s0.copy()
    dense[STEP_HANDLES < 0] = 0.0  # a padding row reads a zero state (as the XLA engine path)
    addr = _addr(arena, STEP_HANDLES)
    o, new = _step(q, k, v, g, beta, *addr, scale=scale, use_qk_l2norm=l2)
    assert o.dtype == v.dtype and o.shape == (b, hv, V)
    one_token = (x[:, None] for x in (q, k, v, g, beta))
    od, sd = recurrent_gated_delta_rule(
        *one_token, jnp.asarray(dense), scale=scale, use_qk_l2norm=l2
    )
    o, od = np.asarray(o, np.float32), np.asarray(od[:, 0], np.float32)
    tol = 1e-5 if dtype == np.float32 else 1e-2  # bf16: o rounded to bf16 by both
    np.testing.assert_allclose(o, od, rtol=tol, atol=tol)
    got, other = _states(new, hv, STEP_HANDLES)
    for row, s in enumerate(got):
        if s is not None:
            np.testing.assert_allclose(s, np.asarray(sd[row]), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(new)[other], arena[other])  # padding untouched too


def _f64_step(q, k, v, g, beta, s, scale, l2):
    """Float64 numpy reference of one token: q, k [Hk, K], v [Hv, V], g, beta [Hv], s [Hv, K, V]."""
    q, k, v, g, beta, s = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, s))
    if l2:
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    grp = v.shape[0] // k.shape[0]
    o, out = np.zeros_like(v), np.zeros_like(s)
    for h in range(v.shape[0]):
        kh, qh = k[h // grp], q[h // grp] * scale
        sh = np.exp(g[h]) * s[h]
        u = beta[h] * (v[h] - sh.T @ kh)
        out[h] = sh + np.outer(kh, u)
        o[h] = out[h].T @ qh
    return o, out


def test_step_matches_float64():
    rng = np.random.default_rng(7)
    b, hk, hv = len(STEP_HANDLES), 1, 2
    q, k, v, g, beta = _inputs(rng, b, hk, hv, np.float32)
    s0 = rng.standard_normal((b, hv, K, V)).astype(np.float32)
    arena = _arena(rng, s0, STEP_HANDLES)
    o, new = _step(q, k, v, g, beta, *_addr(arena, STEP_HANDLES), scale=None, use_qk_l2norm=True)
    got, _ = _states(new, hv, STEP_HANDLES)
    for row, h in enumerate(STEP_HANDLES):
        s = s0[row] if h >= 0 else np.zeros_like(s0[row])
        o64, s64 = _f64_step(q[row], k[row], v[row], g[row], beta[row], s, K**-0.5, True)
        np.testing.assert_allclose(np.asarray(o[row]), o64, rtol=1e-5, atol=1e-5)
        if h >= 0:
            np.testing.assert_allclose(got[row], s64, rtol=1e-5, atol=1e-5)


def test_step_several_tokens_equal_xla_recurrence():
    """Four tokens decoded one call at a time through the arena equal the XLA recurrence over
    the four; row 2 starts fresh (``zero_state``: stale bits ignored, state still written)."""
    rng = np.random.default_rng(3)
    b, hk, hv, t = len(STEP_HANDLES), 1, 2, 4
    q, k, v, g, beta = _inputs(rng, b, hk, hv, np.float32, t=t)
    s0 = rng.standard_normal((b, hv, K, V)).astype(np.float32)
    arena = _arena(rng, s0, STEP_HANDLES)
    dense = s0.copy()
    dense[STEP_HANDLES < 0] = 0.0
    dense[2] = 0.0
    fresh = jnp.asarray([False, False, True])
    buf, table, handles = _addr(arena, STEP_HANDLES)
    outs = []
    for i in range(t):
        token = (x[:, i] for x in (q, k, v, g, beta))
        zero_state = fresh if i == 0 else jnp.zeros_like(fresh)
        o, buf = _step(*token, buf, table, handles, zero_state, scale=None, use_qk_l2norm=True)
        outs.append(o)
    od, sd = recurrent_gated_delta_rule(q, k, v, g, beta, jnp.asarray(dense), use_qk_l2norm=True)
    real = STEP_HANDLES >= 0  # a padding row restarts from zero each call (its state is not kept)
    np.testing.assert_allclose(np.stack(outs, 1)[real], np.asarray(od)[real], rtol=1e-5, atol=1e-5)
    got, other = _states(buf, hv, STEP_HANDLES)
    for row, s in enumerate(got):
        if s is not None:
            np.testing.assert_allclose(s, np.asarray(sd[row]), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(buf)[other], arena[other])


def _assert_matches_arena_reference(o, new, o_ref, new_ref, arena, hv, handles):
    """Kernel ``(o, arena)`` vs its reference's: ``o`` and the written states to f32 level,
    every other word unchanged in both."""
    assert rel_err(np.asarray(o, np.float32), np.asarray(o_ref, np.float32)) < 2e-5
    (got, other), (want, _) = _states(new, hv, handles), _states(new_ref, hv, handles)
    for s, s_ref in zip(got, want, strict=True):
        if s is not None:
            assert rel_err(s, s_ref) < 2e-5
    np.testing.assert_array_equal(np.asarray(new)[other], arena[other])
    np.testing.assert_array_equal(np.asarray(new_ref)[other], arena[other])


def test_step_matches_reference():
    """The step kernel equals ``recurrent_step_arena_reference`` (grouped heads, a padding row,
    a fresh row)."""
    rng = np.random.default_rng(13)
    b, hk, hv = len(STEP_HANDLES), 2, 4
    q, k, v, g, beta = _inputs(rng, b, hk, hv, np.float32)
    arena = _arena(rng, rng.standard_normal((b, hv, K, V)).astype(np.float32), STEP_HANDLES)
    fresh = jnp.asarray([False, False, True])
    kw = dict(scale=None, use_qk_l2norm=True)
    o, new = _step(q, k, v, g, beta, *_addr(arena, STEP_HANDLES), fresh, **kw)
    o_ref, new_ref = recurrent_step_arena_reference(
        q, k, v, g, beta, *_addr(arena, STEP_HANDLES), state_offset=OFFSET, zero_state=fresh, **kw
    )
    _assert_matches_arena_reference(o, new, o_ref, new_ref, arena, hv, STEP_HANDLES)


def _mixed_inputs(rng, b, hk, hv, dtype):
    """The raw inputs of :func:`recurrent_step_mixed`: ``mixed [B, 2 Hk K + Hv V]``, gate
    projections ``a, b [B, Hv]`` and the layer's ``A_log, dt_bias [Hv]`` (the model's init
    ranges), and the same token as split ``q, k, v`` with f64 ``g, beta`` by the model's rule."""
    mixed = jnp.asarray(rng.standard_normal((b, 2 * hk * K + hv * V)), dtype)
    a = rng.standard_normal((b, hv)).astype(np.float32) * 2.0
    bb = rng.standard_normal((b, hv)).astype(np.float32) * 2.0
    a_log = np.log(rng.uniform(1.0, 16.0, hv)).astype(np.float32)
    dt_bias = rng.uniform(0.5, 1.5, hv).astype(np.float32)
    m = np.asarray(mixed, np.float64)
    q = m[:, : hk * K].reshape(b, hk, K)
    k = m[:, hk * K : 2 * hk * K].reshape(b, hk, K)
    v = m[:, 2 * hk * K :].reshape(b, hv, V)
    x = a.astype(np.float64) + dt_bias
    g = -np.exp(a_log.astype(np.float64)) * np.logaddexp(x, 0.0)
    beta = 1.0 / (1.0 + np.exp(-bb.astype(np.float64)))
    raw = (mixed, jnp.asarray(a), jnp.asarray(bb), jnp.asarray(a_log), jnp.asarray(dt_bias))
    return raw, (q, k, v, g, beta)


@pytest.mark.parametrize(
    "dtype, hk, hv, l2",
    [(np.float32, 1, 2, True), (np.float32, 2, 4, False), (jnp.bfloat16, 2, 4, True)],
)
def test_step_mixed_matches_float64(dtype, hk, hv, l2):
    """``recurrent_step_mixed`` on the raw layer inputs equals the float64 step on the split
    channels with the model's gates; a row marked not live keeps its state and reads it out; a
    fresh row starts from zeros; padding and every other word stay untouched."""
    rng = np.random.default_rng(31 + hv)
    handles = np.array([2, -1, 0, 4], np.int32)  # valid, padding, fresh, not live
    fresh, live = np.array([False, False, True, False]), np.array([True, True, True, False])
    b = len(handles)
    raw, (q, k, v, g, beta) = _mixed_inputs(rng, b, hk, hv, dtype)
    s0 = rng.standard_normal((b, hv, K, V)).astype(np.float32)
    arena = _arena(rng, s0, handles, fresh)
    fn = jax.jit(
        functools.partial(
            recurrent_step_mixed, num_k_heads=hk, head_k_dim=K, use_qk_l2norm=l2, **_KERNEL
        ),
        donate_argnums=5,
    )
    o, new = fn(*raw, *_addr(arena, handles), zero_state=jnp.asarray(fresh), live=jnp.asarray(live))
    chex.assert_shape(o, (b, hv, V))
    chex.assert_type(o, dtype)
    got, other = _states(new, hv, handles)
    tol = 2e-5 if dtype == np.float32 else 1e-2
    for row in range(b):
        start = np.zeros((hv, K, V)) if fresh[row] or handles[row] < 0 else s0[row]
        gr, br = (g[row], beta[row]) if live[row] else (np.zeros(hv), np.zeros(hv))
        o64, s64 = _f64_step(q[row], k[row], v[row], gr, br, start, K**-0.5, l2)
        assert rel_err(np.asarray(o[row], np.float32), o64) < tol
        if handles[row] >= 0:
            assert rel_err(got[row], s64) < 2e-5
        else:
            assert got[row] is None
    np.testing.assert_array_equal(np.asarray(new)[other], arena[other])


def test_step_mixed_equals_split_step():
    """The mixed-input kernel and :func:`recurrent_step` on the split channels and
    :func:`step_gates`' gates give the same outputs and states (grouped heads)."""
    rng = np.random.default_rng(37)
    hk, hv = 2, 4
    b = len(STEP_HANDLES)
    (mixed, a, bb, a_log, dt_bias), _ = _mixed_inputs(rng, b, hk, hv, np.float32)
    arena = _arena(rng, rng.standard_normal((b, hv, K, V)).astype(np.float32), STEP_HANDLES)
    q = mixed[:, : hk * K].reshape(b, hk, K)
    k = mixed[:, hk * K : 2 * hk * K].reshape(b, hk, K)
    v = mixed[:, 2 * hk * K :].reshape(b, hv, V)
    g, beta = step_gates(a, bb, a_log, dt_bias)
    o1, new1 = _step(q, k, v, g, beta, *_addr(arena, STEP_HANDLES), use_qk_l2norm=True)
    o2, new2 = recurrent_step_mixed(
        mixed, a, bb, a_log, dt_bias, *_addr(arena, STEP_HANDLES), num_k_heads=hk,
        head_k_dim=K, use_qk_l2norm=True, **_KERNEL,
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(o2), np.asarray(o1), rtol=1e-6, atol=1e-6)
    (s1, other), (s2, _) = _states(new1, hv, STEP_HANDLES), _states(new2, hv, STEP_HANDLES)
    for x1, x2 in zip(s1, s2, strict=True):
        if x1 is not None:
            np.testing.assert_allclose(x2, x1, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(new2)[other], np.asarray(new1)[other])


def test_step_mixed_reads_columns_in_place():
    """``a`` and ``b`` read at ``a_col`` / ``b_col`` of one wider bf16 array (a fused
    projection's output) give the kernel on the separate f32 columns bit for bit."""
    rng = np.random.default_rng(41)
    hk, hv = 2, 4
    b = len(STEP_HANDLES)
    (mixed, a, bb, a_log, dt_bias), _ = _mixed_inputs(rng, b, hk, hv, np.float32)
    a, bb = a.astype(jnp.bfloat16), bb.astype(jnp.bfloat16)
    wide = jnp.concatenate([jnp.ones((b, 3), jnp.bfloat16), bb, a, jnp.ones((b, 2), a.dtype)], 1)
    arena = _arena(rng, rng.standard_normal((b, hv, K, V)).astype(np.float32), STEP_HANDLES)
    call = functools.partial(
        recurrent_step_mixed, num_k_heads=hk, head_k_dim=K, use_qk_l2norm=True, **_KERNEL
    )
    f32 = jnp.float32
    o1, new1 = call(
        mixed, a.astype(f32), bb.astype(f32), a_log, dt_bias, *_addr(arena, STEP_HANDLES)
    )
    o2, new2 = call(
        mixed, wide, wide, a_log, dt_bias, *_addr(arena, STEP_HANDLES), a_col=3 + hv, b_col=3
    )
    np.testing.assert_array_equal(np.asarray(o2), np.asarray(o1))
    np.testing.assert_array_equal(np.asarray(new2), np.asarray(new1))
    with pytest.raises(ValueError, match="^a:"):
        call(mixed, wide, wide, a_log, dt_bias, *_addr(arena, STEP_HANDLES), a_col=6 + hv)


def _gated_norm64(o, w, z, eps):
    """The gated RMSNorm of one value head per row, float64: ``w * rmsnorm(o) * silu(z)``."""
    o, w, z = (np.asarray(x, np.float64) for x in (o, w, z))
    y = o / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + eps) * w
    return y * z / (1.0 + np.exp(-z))


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_step_mixed_gated_norm(dtype):
    """With ``norm_weight`` and ``z`` (read at ``z_col`` of a wider array), the kernel's output
    is the layer's gated RMSNorm of the plain kernel's output: against float64 and against
    :class:`gdn_jax.models.norm.GatedRMSNorm` on that output (its roundings: equal up to an
    ulp of the gate's SiLU); the states and every arena word equal the plain call's."""
    from gdn_jax.models.norm import GatedRMSNorm

    rng = np.random.default_rng(43)
    hk, hv, eps = 2, 4, 1e-6
    handles = np.array([2, -1, 0, 4], np.int32)
    fresh, live = np.array([False, False, True, False]), np.array([True, True, True, False])
    b = len(handles)
    raw, _ = _mixed_inputs(rng, b, hk, hv, dtype)
    w = jnp.asarray(rng.uniform(0.5, 1.5, V), dtype)
    z = jnp.asarray(rng.standard_normal((b, hv * V)) * 2.0, dtype)
    wide = jnp.concatenate([jnp.ones((b, 5), dtype), z, jnp.ones((b, 3), dtype)], 1)
    arena = _arena(rng, rng.standard_normal((b, hv, K, V)).astype(np.float32), handles, fresh)
    call = functools.partial(
        recurrent_step_mixed, *raw, *_addr(arena, handles), num_k_heads=hk, head_k_dim=K,
        use_qk_l2norm=True, zero_state=jnp.asarray(fresh), live=jnp.asarray(live), **_KERNEL,
    )  # fmt: skip
    o, new = call()
    y, new_n = call(norm_weight=w, z=wide, z_col=5, norm_eps=eps)
    chex.assert_shape(y, (b, hv, V))
    chex.assert_type(y, dtype)
    np.testing.assert_array_equal(np.asarray(new_n), np.asarray(new))
    zh = z.reshape(b, hv, V)
    y64 = _gated_norm64(np.asarray(o, np.float32), np.asarray(w, np.float32), zh, eps)
    tol = 2e-6 if dtype == np.float32 else 1e-2
    assert rel_err(np.asarray(y, np.float32), y64) < tol
    norm = GatedRMSNorm(V, eps=eps, dtype=dtype)
    norm.weight[...] = w
    want = np.asarray(norm(o, zh), np.float32)
    np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=tol, atol=tol)
    if dtype == jnp.bfloat16:  # the same roundings: almost every element equal
        assert np.mean(np.asarray(y, np.float32) == want) > 0.9
    for name, kw in [
        ("norm_weight", dict(norm_weight=w[:-1], z=wide)),
        ("z", dict(norm_weight=w, z=wide, z_col=9)),
        ("z", dict(norm_weight=w, z=wide[:2])),
        ("z", dict(z=wide)),
    ]:
        with pytest.raises(ValueError, match=f"^{name}"):
            call(**kw)


@pytest.mark.parametrize(
    "name, change",
    [
        ("mixed", lambda x: dict(mixed=x["mixed"][:, None])),
        ("mixed", lambda x: dict(mixed=x["mixed"][:, :-1])),
        ("V", lambda x: dict(mixed=x["mixed"][:, :-8])),
        ("a", lambda x: dict(a=x["a"][:2])),
        ("b", lambda x: dict(b=x["b"][:, :1])),
        ("a_log", lambda x: dict(a_log=x["a_log"][:1])),
        ("dt_bias", lambda x: dict(dt_bias=x["dt_bias"][None])),
        ("live", lambda x: dict(live=jnp.ones((2,), bool))),
        ("block_v", lambda x: dict(block_v=24)),
        ("handles", lambda x: dict(handles=x["handles"][:2])),
    ],
)
def test_step_mixed_bad_inputs_raise(name, change):
    rng = np.random.default_rng(2)
    (mixed, a, bb, a_log, dt_bias), _ = _mixed_inputs(rng, len(STEP_HANDLES), 1, 2, np.float32)
    arena, table, handles = _addr(np.zeros((SEGMENTS, WORDS), np.uint32), STEP_HANDLES)
    ok = dict(
        mixed=mixed, a=a, b=bb, a_log=a_log, dt_bias=dt_bias, arena=arena, table=table,
        handles=handles,
    )  # fmt: skip
    _call_bad(
        functools.partial(recurrent_step_mixed, num_k_heads=1, head_k_dim=K), ok, name, change
    )


STEP_BAD = [  # (argument named by the error, replaced inputs or options)
    ("q", lambda x: dict(q=x["q"][:, :, :8])),
    ("k", lambda x: dict(k=x["k"][:, None])),
    ("v", lambda x: dict(v=x["v"][:2])),
    ("v", lambda x: dict(q=jnp.zeros((3, 2, K)), k=jnp.zeros((3, 2, K)), v=jnp.zeros((3, 3, V)))),
    ("V", lambda x: dict(v=jnp.zeros((3, 2, 24)))),
    ("K", lambda x: dict(q=jnp.zeros((3, 1, 8)), k=jnp.zeros((3, 1, 8)))),
    ("q", lambda x: dict(q=x["q"].astype(jnp.int32))),
    ("g", lambda x: dict(g=x["g"][:, :1])),
    ("beta", lambda x: dict(beta=x["beta"].astype(jnp.int32))),
    ("arena", lambda x: dict(arena=x["arena"].astype(jnp.int32))),
    ("table", lambda x: dict(table=x["table"][:, :1])),
    ("handles", lambda x: dict(handles=x["handles"][:2])),
    ("state_offset", lambda x: dict(state_offset=WORDS)),
    ("block_v", lambda x: dict(block_v=24)),
    ("zero_state", lambda x: dict(zero_state=jnp.zeros((2,), bool))),
]


def _call_bad(fn, ok, name, change):
    """``fn`` on the inputs ``ok`` with ``change`` (inputs replaced, options added) raises a
    ValueError whose message starts with ``name``."""
    kw = change(ok)
    args = {**ok, **{n: x for n, x in kw.items() if n in ok}}
    opts = {n: x for n, x in kw.items() if n not in ok}
    with pytest.raises(ValueError, match=f"^{name}"):
        fn(*args.values(), **{"state_offset": OFFSET, **opts}, interpret=True)


@pytest.mark.parametrize("name, change", STEP_BAD)
def test_step_bad_inputs_raise(name, change):
    rng = np.random.default_rng(1)
    q, k, v, g, beta = _inputs(rng, len(STEP_HANDLES), 1, 2, np.float32)
    a, t, h = (
        jnp.zeros((SEGMENTS, WORDS), jnp.uint32),
        jnp.asarray(TABLE),
        jnp.asarray(STEP_HANDLES),
    )
    ok = dict(q=q, k=k, v=v, g=g, beta=beta, arena=a, table=t, handles=h)
    _call_bad(recurrent_step, ok, name, change)


# ----------------------------------------------------------------- T tokens per row (prefill)


def _f64(q, k, v, g, beta, s, n, scale, l2):
    """Float64 sequential reference of one row: q, k [T, Hk, K], v [T, Hv, V], g, beta [T, Hv],
    s [Hv, K, V]; tokens t >= n leave the state alone, their output is S^T q."""
    q, k, v, g, beta, s = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, s))
    if l2:
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    t, hv = v.shape[:2]
    grp = hv // k.shape[1]
    s, o = s.copy(), np.zeros_like(v)
    for i in range(t):
        for h in range(hv):
            kh, qh = k[i, h // grp], q[i, h // grp] * scale
            if i < n:
                sh = np.exp(g[i, h]) * s[h]
                s[h] = sh + np.outer(kh, beta[i, h] * (v[i, h] - sh.T @ kh))
            o[i, h] = s[h].T @ qh
    return o, s


PREFILL_CASES = [  # dtype, T, Hk, Hv, l2, scale, num_tokens
    (np.float32, 8, 1, 2, True, None, [5, 3, 8, 0]),
    (jnp.bfloat16, 16, 2, 4, True, None, [16, 16, 7, 0]),
    (np.float32, 6, 2, 2, False, 0.3, [6, 0, 1, 0]),  # T not a power of two
]


@pytest.mark.parametrize("dtype, t, hk, hv, l2, scale, nt", PREFILL_CASES)
def test_prefill_matches_references(dtype, t, hk, hv, l2, scale, nt):
    rng = np.random.default_rng(t + hv)
    b = len(PREFILL_HANDLES)
    q, k, v, g, beta = _inputs(rng, b, hk, hv, dtype, t=t)
    s0 = rng.standard_normal((b, hv, K, V)).astype(np.float32)
    arena = _arena(rng, s0, PREFILL_HANDLES, FRESH)
    nt = np.asarray(nt, np.int32)
    start = s0.copy()
    start[(PREFILL_HANDLES < 0) | FRESH] = 0.0  # padding and fresh rows start from zero
    rows = (jnp.asarray(nt), jnp.asarray(FRESH))
    addr = _addr(arena, PREFILL_HANDLES)
    o, new = _prefill(q, k, v, g, beta, *addr, *rows, scale=scale, use_qk_l2norm=l2)
    assert o.dtype == v.dtype and o.shape == (b, t, hv, V)
    new = np.asarray(new)
    got, other = _states(new, hv, PREFILL_HANDLES)
    np.testing.assert_array_equal(new[other], arena[other])  # padding row's place untouched too
    # float64 sequential reference, every row and token (masked tokens: S^T q)
    o32 = np.asarray(o, np.float32)
    qf, kf, vf = (np.asarray(x, np.float32) for x in (q, k, v))
    tol = 2e-5 if dtype == np.float32 else 1e-2  # bf16: o rounded to bf16
    scale64 = K**-0.5 if scale is None else scale
    for row in range(b):
        row_inputs = (qf[row], kf[row], vf[row], g[row], beta[row])
        o64, s64 = _f64(*row_inputs, start[row], nt[row], scale64, l2)
        np.testing.assert_allclose(o32[row], o64, rtol=tol, atol=tol)
        if got[row] is not None:
            np.testing.assert_allclose(got[row], s64, rtol=2e-5, atol=2e-5)
    # gdn_jax's recurrence with the engine's padding (g = beta = 0 past num_tokens)
    live = (np.arange(t)[None, :] < nt[:, None])[..., None]
    g_live, beta_live = jnp.where(live, g, 0.0), jnp.where(live, beta, 0.0)
    od, sd = recurrent_gated_delta_rule(
        q, k, v, g_live, beta_live, jnp.asarray(start), scale=scale, use_qk_l2norm=l2
    )
    np.testing.assert_allclose(o32, np.asarray(od, np.float32), rtol=tol, atol=tol)
    for row, s in enumerate(got):
        if s is not None:
            np.testing.assert_allclose(s, np.asarray(sd[row]), rtol=1e-5, atol=1e-5)
    assert not np.array_equal(got[0], s0[0])  # the kernel wrote the row
    np.testing.assert_array_equal(got[3], s0[3])  # num_tokens 0: written back unchanged
    if nt[2] == 0:
        assert not got[2].any()


def test_prefill_two_chunks_equal_one():
    """Prefilling 8 tokens as two chunks of 4 through the arena equals one chunk of 8."""
    rng = np.random.default_rng(11)
    b, hv = len(PREFILL_HANDLES), 2
    q, k, v, g, beta = _inputs(rng, b, 1, hv, np.float32, t=8)
    s0 = rng.standard_normal((b, hv, K, V)).astype(np.float32)
    arena = _arena(rng, s0, PREFILL_HANDLES, FRESH)
    _, table, handles = _addr(arena, PREFILL_HANDLES)
    full = jnp.full((b,), 8, jnp.int32)
    kw = dict(scale=None, use_qk_l2norm=True)
    o1, a1 = _prefill(
        q, k, v, g, beta, jnp.asarray(arena), table, handles, full, jnp.asarray(FRESH), **kw
    )
    buf, outs = jnp.asarray(arena), []
    for c in range(2):
        chunk = (x[:, 4 * c : 4 * c + 4] for x in (q, k, v, g, beta))
        fresh = jnp.asarray(FRESH & (c == 0))
        o, buf = _prefill(*chunk, buf, table, handles, full // 2, fresh, **kw)
        outs.append(o)
    real = PREFILL_HANDLES >= 0  # a padding row restarts from zero each call
    two_chunks = np.concatenate(outs, 1)[real]
    np.testing.assert_allclose(two_chunks, np.asarray(o1)[real], rtol=1e-5, atol=1e-5)
    (two, other), (one, _) = _states(buf, hv, PREFILL_HANDLES), _states(a1, hv, PREFILL_HANDLES)
    for s2, s1 in zip(two, one, strict=True):
        if s1 is not None:
            np.testing.assert_allclose(s2, s1, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(buf)[other], arena[other])


def test_prefill_matches_reference():
    """The prefill kernel equals ``recurrent_prefill_arena_reference`` (ragged num_tokens,
    grouped heads, T not a power of two, a padding row, a fresh row)."""
    rng = np.random.default_rng(17)
    b, hk, hv, t = len(PREFILL_HANDLES), 1, 2, 5
    q, k, v, g, beta = _inputs(rng, b, hk, hv, np.float32, t=t)
    s0 = rng.standard_normal((b, hv, K, V)).astype(np.float32)
    arena = _arena(rng, s0, PREFILL_HANDLES, FRESH)
    nt, fresh = jnp.asarray([3, 5, 5, 0], jnp.int32), jnp.asarray(FRESH)
    kw = dict(scale=0.3, use_qk_l2norm=True)
    o, new = _prefill(q, k, v, g, beta, *_addr(arena, PREFILL_HANDLES), nt, fresh, **kw)
    o_ref, new_ref = recurrent_prefill_arena_reference(
        *(q, k, v, g, beta, *_addr(arena, PREFILL_HANDLES)),
        state_offset=OFFSET,
        num_tokens=nt,
        zero_state=fresh,
        **kw,
    )
    _assert_matches_arena_reference(o, new, o_ref, new_ref, arena, hv, PREFILL_HANDLES)


PREFILL_BAD = [  # (argument named by the error, replaced inputs or options)
    ("q", lambda x: dict(q=x["q"][..., :8])),
    ("k", lambda x: dict(k=x["k"][:, 0])),
    ("v", lambda x: dict(v=x["v"][:, :2])),
    ("V", lambda x: dict(v=jnp.zeros((4, 4, 2, 24)))),
    ("g", lambda x: dict(g=x["g"][:, :, :1])),
    ("beta", lambda x: dict(beta=x["beta"].astype(jnp.int32))),
    ("T", lambda x: {n: x[n][:, :0] for n in ("q", "k", "v", "g", "beta")}),
    ("handles", lambda x: dict(handles=x["handles"][:2])),
    ("state_offset", lambda x: dict(state_offset=WORDS)),
    ("num_tokens", lambda x: dict(num_tokens=jnp.zeros((2,), jnp.int32))),
    ("zero_state", lambda x: dict(zero_state=jnp.zeros((2,), bool))),
]


@pytest.mark.parametrize("name, change", PREFILL_BAD)
def test_prefill_bad_inputs_raise(name, change):
    rng = np.random.default_rng(1)
    q, k, v, g, beta = _inputs(rng, len(PREFILL_HANDLES), 1, 2, np.float32, t=4)
    a = jnp.zeros((SEGMENTS, WORDS), jnp.uint32)
    ok = dict(q=q, k=k, v=v, g=g, beta=beta, arena=a, table=jnp.asarray(TABLE))
    ok["handles"] = jnp.asarray(PREFILL_HANDLES)
    _call_bad(recurrent_prefill, ok, name, change)


# --------------------------------------------------------------- the reference vs float64


@settings(max_examples=6, deadline=None)
@given(
    heads=head_shapes(),
    t=st.sampled_from([1, 6]),
    l2=st.booleans(),
    scale=st.sampled_from([None, 0.3]),
    seed=st.integers(0, 999),
)
def test_reference_matches_float64(heads, t, l2, scale, seed):
    """``decode/reference.py``: the prefill reference equals the float64 recurrence over each
    row's first ``num_tokens`` tokens, the later tokens reading ``S^T q`` of the unchanged
    state; the step reference is the prefill of one token."""
    hk, hv, dk, dv = heads
    rng = np.random.default_rng(seed)
    b = 3
    q, k, v, g, beta, s0 = make_inputs(rng, b, t, hk, hv, dk, dv, decay="mixed")
    nt = np.array([t, 0, rng.integers(0, t + 1)], np.int32)
    kw = dict(scale=scale, use_qk_l2norm=l2)
    o, final = recurrent_prefill_reference(q, k, v, g, beta, s0, num_tokens=jnp.asarray(nt), **kw)
    chex.assert_shape(o, (b, t, hv, dv))
    q64, _ = prep64(q, k, scale, l2)
    grp = hv // hk
    for r in range(b):
        n = nt[r]
        live = (x[r : r + 1, :n] for x in (q, k, v, g, beta))
        o64, s64 = recurrent64(*live, s0[r : r + 1], **kw)
        assert rel_err(final[r], s64[0]) < 1e-5
        if n:
            assert rel_err(o[r, :n], o64[0]) < 1e-5
        if n < t:  # masked tokens: S^T q of the unchanged state, per value head
            o_masked = np.einsum("hkv,thk->thv", s64[0], q64[r][n:][:, np.arange(hv) // grp])
            assert rel_err(o[r, n:], o_masked) < 1e-5
    o1, s1 = recurrent_step_reference(*(x[:, 0] for x in (q, k, v, g, beta)), s0, **kw)
    o64, s64 = recurrent64(*(x[:, :1] for x in (q, k, v, g, beta)), s0, **kw)
    assert rel_err(o1, o64[:, 0]) < 1e-5 and rel_err(s1, s64) < 1e-5
