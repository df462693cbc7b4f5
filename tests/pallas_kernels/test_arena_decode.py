"""The arena decode kernel (pallas_kernels.decode.arena.recurrent_step, interpret mode): one token
of the gated delta rule on states read from, and written back in place into, a uint32 arena
through a handle table equals gdn_jax.recurrent_gated_delta_rule (one step and several in a
row) and a float64 numpy reference; no other arena word changes; padding rows are never
written."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn_jax import recurrent_gated_delta_rule
from pallas_kernels.decode.arena import recurrent_step

K, V = 16, 32
SEGMENTS, WORDS, OFFSET = 5, 4096, 100
TABLE = np.array([[4, 5], [1, 2000], [2, 17], [0, 301]], np.int32)
HANDLES = np.array([2, -1, 0], np.int32)  # row 1 is padding


def _inputs(rng, b, hk, hv, dtype, t=None):
    lead = (b,) if t is None else (b, t)
    cast = lambda x, dt=dtype: jnp.asarray(x, dt)
    q, k = (cast(rng.standard_normal((*lead, hk, K))) for _ in range(2))
    v = cast(rng.standard_normal((*lead, hv, V)))
    g = cast(-rng.uniform(0.01, 0.3, (*lead, hv)), jnp.float32)
    beta = cast(rng.uniform(0.2, 1.0, (*lead, hv)), jnp.float32)
    return q, k, v, g, beta


def _arena(rng, s0):
    """Garbage everywhere, each valid row's state at its handle's (unaligned) place."""
    hv = s0.shape[1]
    arena = rng.integers(0, 2**32, (SEGMENTS, WORDS), dtype=np.uint32)
    for row, h in enumerate(HANDLES):
        if h >= 0:
            seg, span = _span(h, hv)
            arena[seg, span] = s0[row].reshape(-1).view(np.uint32)
    return arena


def _span(h, hv, table=TABLE, k=K, v=V):
    seg, word = table[h]
    return seg, slice(word + OFFSET, word + OFFSET + hv * k * v)


def _states(arena, hv, handles=HANDLES, table=TABLE, k=K, v=V):
    """The valid rows' states in ``arena`` (padding rows: None) and a mask of every other word
    (also the arena prefill tests', with their own table and handles)."""
    other = np.ones(arena.shape, bool)
    out = []
    for h in handles:
        if h < 0:
            out.append(None)
            continue
        seg, span = _span(h, hv, table, k, v)
        out.append(arena[seg, span].view(np.float32).reshape(hv, k, v))
        other[seg, span] = False
    return out, other


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm"), donate_argnums=5)
def _step(q, k, v, g, beta, arena, table, handles, zero_state=None, *, scale, use_qk_l2norm):
    return recurrent_step(
        q, k, v, g, beta, arena, table, handles, state_offset=OFFSET, scale=scale,
        use_qk_l2norm=use_qk_l2norm, zero_state=zero_state, block_v=16, interpret=True,
    )  # fmt: skip


@pytest.mark.parametrize(
    "dtype, hk, hv, l2, scale",
    [
        (np.float32, 1, 2, True, None),
        (jnp.bfloat16, 2, 4, False, None),
        (np.float32, 2, 4, False, 0.3),
    ],
)
def test_one_step_matches_recurrent_rule(dtype, hk, hv, l2, scale):
    rng = np.random.default_rng(hv + l2)
    b = len(HANDLES)
    q, k, v, g, beta = _inputs(rng, b, hk, hv, dtype)
    s0 = rng.standard_normal((b, hv, K, V)).astype(np.float32)
    arena = _arena(rng, s0)
    dense = s0.copy()
    dense[HANDLES < 0] = 0.0  # a padding row reads a zero state (as the XLA engine path)
    o, new = _step(q, k, v, g, beta, jnp.asarray(arena), jnp.asarray(TABLE),
                   jnp.asarray(HANDLES), scale=scale, use_qk_l2norm=l2)  # fmt: skip
    assert o.dtype == v.dtype and o.shape == (b, hv, V)
    od, sd = recurrent_gated_delta_rule(
        *(x[:, None] for x in (q, k, v, g, beta)), jnp.asarray(dense), scale=scale,
        use_qk_l2norm=l2)  # fmt: skip
    o, od = np.asarray(o, np.float32), np.asarray(od[:, 0], np.float32)
    tol = 1e-5 if dtype == np.float32 else 1e-2  # bf16: o rounded to bf16 by both
    np.testing.assert_allclose(o, od, rtol=tol, atol=tol)
    got, other = _states(np.asarray(new), hv)
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


def test_one_step_matches_float64_reference():
    rng = np.random.default_rng(7)
    b, hk, hv = len(HANDLES), 1, 2
    q, k, v, g, beta = _inputs(rng, b, hk, hv, np.float32)
    s0 = rng.standard_normal((b, hv, K, V)).astype(np.float32)
    arena = _arena(rng, s0)
    o, new = _step(q, k, v, g, beta, jnp.asarray(arena), jnp.asarray(TABLE),
                   jnp.asarray(HANDLES), scale=None, use_qk_l2norm=True)  # fmt: skip
    got, _ = _states(np.asarray(new), hv)
    for row, h in enumerate(HANDLES):
        s = s0[row] if h >= 0 else np.zeros_like(s0[row])
        o64, s64 = _f64_step(q[row], k[row], v[row], g[row], beta[row], s, K**-0.5, True)
        np.testing.assert_allclose(np.asarray(o[row]), o64, rtol=1e-5, atol=1e-5)
        if h >= 0:
            np.testing.assert_allclose(got[row], s64, rtol=1e-5, atol=1e-5)


def test_several_tokens_equal_xla_recurrence():
    """Four tokens decoded one call at a time through the arena equal the XLA recurrence over
    the four; row 2 starts fresh (``zero_state``: stale bits ignored, state still written)."""
    rng = np.random.default_rng(3)
    b, hk, hv, t = len(HANDLES), 1, 2, 4
    q, k, v, g, beta = _inputs(rng, b, hk, hv, np.float32, t=t)
    s0 = rng.standard_normal((b, hv, K, V)).astype(np.float32)
    arena = _arena(rng, s0)
    dense = s0.copy()
    dense[HANDLES < 0] = 0.0
    dense[2] = 0.0
    fresh = jnp.asarray([False, False, True])
    buf, table, handles = jnp.asarray(arena), jnp.asarray(TABLE), jnp.asarray(HANDLES)
    outs = []
    for i in range(t):
        o, buf = _step(q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i], buf, table, handles,
                       fresh if i == 0 else jnp.zeros_like(fresh), scale=None,
                       use_qk_l2norm=True)  # fmt: skip
        outs.append(o)
    od, sd = recurrent_gated_delta_rule(q, k, v, g, beta, jnp.asarray(dense), use_qk_l2norm=True)
    real = HANDLES >= 0  # a padding row restarts from zero each call (its state is not kept)
    np.testing.assert_allclose(np.stack(outs, 1)[real], np.asarray(od)[real], rtol=1e-5, atol=1e-5)
    got, other = _states(np.asarray(buf), hv)
    for row, s in enumerate(got):
        if s is not None:
            np.testing.assert_allclose(s, np.asarray(sd[row]), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(buf)[other], arena[other])


def test_bad_inputs_raise():
    rng = np.random.default_rng(1)
    b, hk, hv = len(HANDLES), 1, 2
    q, k, v, g, beta = _inputs(rng, b, hk, hv, np.float32)
    a, t, h = jnp.zeros((SEGMENTS, WORDS), jnp.uint32), jnp.asarray(TABLE), jnp.asarray(HANDLES)
    ok = dict(q=q, k=k, v=v, g=g, beta=beta, arena=a, table=t, handles=h)

    def call(**kw):
        args = {**ok, **{n: x for n, x in kw.items() if n in ok}}
        opts = {n: x for n, x in kw.items() if n not in ok}
        return recurrent_step(*args.values(), **{"state_offset": OFFSET, **opts}, interpret=True)

    cases = [
        ("q", dict(q=q[:, :, :8])),
        ("k", dict(k=k[:, None])),
        ("v", dict(v=v[:2])),
        ("v", dict(q=jnp.zeros((b, 2, K)), k=jnp.zeros((b, 2, K)), v=jnp.zeros((b, 3, V)))),
        ("V", dict(v=jnp.zeros((b, hv, 24)))),
        ("K", dict(q=jnp.zeros((b, hk, 8)), k=jnp.zeros((b, hk, 8)))),
        ("q", dict(q=q.astype(jnp.int32))),
        ("g", dict(g=g[:, :1])),
        ("beta", dict(beta=beta.astype(jnp.int32))),
        ("arena", dict(arena=a.astype(jnp.int32))),
        ("table", dict(table=t[:, :1])),
        ("handles", dict(handles=h[:2])),
        ("state_offset", dict(state_offset=WORDS)),
        ("block_v", dict(block_v=24)),
        ("zero_state", dict(zero_state=jnp.zeros((2,), bool))),
    ]
    for name, kw in cases:
        with pytest.raises(ValueError, match=f"^{name}"):
            call(**kw)
