"""The arena prefill kernel (pallas_kernels.decode.arena.recurrent_prefill, interpret mode): T
tokens of the gated delta rule per row, ragged num_tokens (0 and T included), the initial
states read from, and the final states written back in place into, a uint32 arena through a
handle table, equal a float64 numpy sequential reference and gdn_jax.recurrent_gated_delta_rule;
no other arena word changes; padding rows (handle -1) are never written; fresh rows
(zero_state) ignore their unit's stale bits and are written."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn_jax import recurrent_gated_delta_rule
from pallas_kernels.decode.arena import recurrent_prefill
from tests.pallas_kernels import test_arena_decode as decode_tests

K, V = 16, 32
SEGMENTS, WORDS, OFFSET = 5, 4096, 100
# rows: a valid row, padding, a fresh row (stale unit), a valid row with num_tokens 0
TABLE = np.array([[4, 5], [1, 2000], [2, 17], [0, 301], [3, 1000]], np.int32)
HANDLES = np.array([2, -1, 0, 4], np.int32)
FRESH = np.array([False, False, True, False])


def _inputs(rng, b, t, hk, hv, dtype):
    cast = lambda x, dt=dtype: jnp.asarray(x, dt)
    q, k = (cast(rng.standard_normal((b, t, hk, K))) for _ in range(2))
    v = cast(rng.standard_normal((b, t, hv, V)))
    g = cast(-rng.uniform(0.01, 0.3, (b, t, hv)), jnp.float32)
    beta = cast(rng.uniform(0.2, 1.0, (b, t, hv)), jnp.float32)
    return q, k, v, g, beta


def _span(h, hv):
    return decode_tests._span(h, hv, TABLE, K, V)


def _arena(rng, s0):
    """Garbage everywhere (NaN patterns included), each valid row's state at its handle's
    (unaligned) place; a fresh row's unit keeps its garbage."""
    hv = s0.shape[1]
    arena = rng.integers(0, 2**32, (SEGMENTS, WORDS), dtype=np.uint32)
    for row, h in enumerate(HANDLES):
        if h >= 0 and not FRESH[row]:
            seg, span = _span(h, hv)
            arena[seg, span] = s0[row].reshape(-1).view(np.uint32)
    return arena


def _states(arena, hv):
    return decode_tests._states(arena, hv, HANDLES, TABLE, K, V)


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm"), donate_argnums=5)
def _prefill(q, k, v, g, beta, arena, table, handles, num_tokens, zero_state, *, scale,
             use_qk_l2norm):  # fmt: skip
    return recurrent_prefill(
        q, k, v, g, beta, arena, table, handles, state_offset=OFFSET, num_tokens=num_tokens,
        scale=scale, use_qk_l2norm=use_qk_l2norm, zero_state=zero_state, block_v=16,
        interpret=True,
    )  # fmt: skip


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


CASES = [  # dtype, T, Hk, Hv, l2, scale, num_tokens
    (np.float32, 8, 1, 2, True, None, [5, 3, 8, 0]),
    (jnp.bfloat16, 16, 2, 4, True, None, [16, 16, 7, 0]),
    (np.float32, 6, 2, 2, False, 0.3, [6, 0, 1, 0]),  # T not a power of two
]


@pytest.mark.parametrize("dtype, t, hk, hv, l2, scale, nt", CASES)
def test_prefill_matches_references(dtype, t, hk, hv, l2, scale, nt):
    rng = np.random.default_rng(t + hv)
    b = len(HANDLES)
    q, k, v, g, beta = _inputs(rng, b, t, hk, hv, dtype)
    s0 = rng.standard_normal((b, hv, K, V)).astype(np.float32)
    arena = _arena(rng, s0)
    nt = np.asarray(nt, np.int32)
    start = s0.copy()
    start[(HANDLES < 0) | FRESH] = 0.0  # padding and fresh rows start from zero
    o, new = _prefill(q, k, v, g, beta, jnp.asarray(arena), jnp.asarray(TABLE),
                      jnp.asarray(HANDLES), jnp.asarray(nt), jnp.asarray(FRESH), scale=scale,
                      use_qk_l2norm=l2)  # fmt: skip
    assert o.dtype == v.dtype and o.shape == (b, t, hv, V)
    new = np.asarray(new)
    got, other = _states(new, hv)
    np.testing.assert_array_equal(new[other], arena[other])  # padding row's place untouched too
    # float64 sequential reference, every row and token (masked tokens: S^T q)
    o32 = np.asarray(o, np.float32)
    qf, kf, vf = (np.asarray(x, np.float32) for x in (q, k, v))
    tol = 2e-5 if dtype == np.float32 else 1e-2  # bf16: o rounded to bf16
    for row in range(b):
        o64, s64 = _f64(qf[row], kf[row], vf[row], g[row], beta[row], start[row], nt[row],
                        K**-0.5 if scale is None else scale, l2)  # fmt: skip
        np.testing.assert_allclose(o32[row], o64, rtol=tol, atol=tol)
        if got[row] is not None:
            np.testing.assert_allclose(got[row], s64, rtol=2e-5, atol=2e-5)
    # gdn_jax's recurrence with the engine's padding (g = beta = 0 past num_tokens)
    live = (np.arange(t)[None, :] < nt[:, None])[..., None]
    od, sd = recurrent_gated_delta_rule(
        q, k, v, jnp.where(live, g, 0.0), jnp.where(live, beta, 0.0), jnp.asarray(start),
        scale=scale, use_qk_l2norm=l2)  # fmt: skip
    np.testing.assert_allclose(o32, np.asarray(od, np.float32), rtol=tol, atol=tol)
    for row, s in enumerate(got):
        if s is not None:
            np.testing.assert_allclose(s, np.asarray(sd[row]), rtol=1e-5, atol=1e-5)
    assert not np.array_equal(got[0], s0[0])  # the kernel wrote the row
    np.testing.assert_array_equal(got[3], s0[3])  # num_tokens 0: written back unchanged
    if nt[2] == 0:
        assert not got[2].any()


def test_two_chunks_equal_one():
    """Prefilling 8 tokens as two chunks of 4 through the arena equals one chunk of 8."""
    rng = np.random.default_rng(11)
    b, hv = len(HANDLES), 2
    q, k, v, g, beta = _inputs(rng, b, 8, 1, hv, np.float32)
    s0 = rng.standard_normal((b, hv, K, V)).astype(np.float32)
    arena = _arena(rng, s0)
    table, handles = jnp.asarray(TABLE), jnp.asarray(HANDLES)
    full = jnp.full((b,), 8, jnp.int32)
    o1, a1 = _prefill(q, k, v, g, beta, jnp.asarray(arena), table, handles, full,
                      jnp.asarray(FRESH), scale=None, use_qk_l2norm=True)  # fmt: skip
    buf, outs = jnp.asarray(arena), []
    for c in range(2):
        sl = slice(4 * c, 4 * c + 4)
        o, buf = _prefill(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], buf, table,
                          handles, full // 2, jnp.asarray(FRESH & (c == 0)), scale=None,
                          use_qk_l2norm=True)  # fmt: skip
        outs.append(o)
    real = HANDLES >= 0  # a padding row restarts from zero each call
    np.testing.assert_allclose(np.concatenate(outs, 1)[real], np.asarray(o1)[real], rtol=1e-5,
                               atol=1e-5)  # fmt: skip
    (two, other), (one, _) = _states(np.asarray(buf), hv), _states(np.asarray(a1), hv)
    for s2, s1 in zip(two, one, strict=True):
        if s1 is not None:
            np.testing.assert_allclose(s2, s1, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(buf)[other], arena[other])


def test_bad_inputs_raise():
    rng = np.random.default_rng(1)
    b, t, hk, hv = len(HANDLES), 4, 1, 2
    q, k, v, g, beta = _inputs(rng, b, t, hk, hv, np.float32)
    a, tb, h = jnp.zeros((SEGMENTS, WORDS), jnp.uint32), jnp.asarray(TABLE), jnp.asarray(HANDLES)
    ok = dict(q=q, k=k, v=v, g=g, beta=beta, arena=a, table=tb, handles=h)

    def call(**kw):
        args = {**ok, **{n: x for n, x in kw.items() if n in ok}}
        opts = {n: x for n, x in kw.items() if n not in ok}
        return recurrent_prefill(*args.values(), **{"state_offset": OFFSET, **opts},
                                 interpret=True)  # fmt: skip

    cases = [
        ("q", dict(q=q[..., :8])),
        ("k", dict(k=k[:, 0])),
        ("v", dict(v=v[:, :2])),
        ("V", dict(v=jnp.zeros((b, t, hv, 24)))),
        ("g", dict(g=g[:, :, :1])),
        ("beta", dict(beta=beta.astype(jnp.int32))),
        ("T", dict(q=q[:, :0], k=k[:, :0], v=v[:, :0], g=g[:, :0], beta=beta[:, :0])),
        ("handles", dict(handles=h[:2])),
        ("state_offset", dict(state_offset=WORDS)),
        ("num_tokens", dict(num_tokens=jnp.zeros((2,), jnp.int32))),
        ("zero_state", dict(zero_state=jnp.zeros((2,), bool))),
    ]
    for name, kw in cases:
        with pytest.raises(ValueError, match=f"^{name}"):
            call(**kw)
