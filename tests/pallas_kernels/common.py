"""Inputs and arena helpers shared by the Pallas kernel tests (interpret mode: tiny shapes)."""

from __future__ import annotations

import chex
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from gdn_jax import tree_verify
from tests.gdn_jax.reference import rel_err, tree64
from tests.gdn_jax.strategies import make_inputs

TOL = {np.float32: 2e-5, jnp.bfloat16: 1e-2}  # bf16: output rounding
# row 0: a forest (two roots) with a padding node; row 1: a chain
FIXED_TREE = np.array(
    [[-1, 0, 0, 1, 1, 2, -1, 6, 7, -2], [-1, 0, 1, 2, 3, 4, 5, 6, 7, 8]], np.int32
)


def tree_inputs(parents, hk, hv, dk, dv, dtype, seed=0, decay="mild"):
    """Random ``q, k, v`` in ``dtype`` and f32 ``g, beta, S0`` for a ``[B, N]`` tree."""
    b, n = parents.shape
    rng = np.random.default_rng(seed)
    q, k, v, g, beta, s0 = make_inputs(rng, b, n, hk, hv, dk, dv, decay=decay)
    cast = lambda x: jnp.asarray(x, dtype)
    return cast(q), cast(k), cast(v), jnp.asarray(g), jnp.asarray(beta), jnp.asarray(s0)


def state_span(table, h, offset, size):
    """``(segment, word slice)`` of the ``size`` state words of handle ``h``."""
    seg, word = table[h]
    return seg, slice(word + offset, word + offset + size)


def place_states(arena, table, handles, states, offset, skip=None):
    """Writes ``states[row]`` (f32) as words at each valid row's handle, in place; rows with a
    handle ``< 0`` or ``skip[row]`` keep the arena's words."""
    for row, h in enumerate(handles):
        if h >= 0 and not (skip is not None and skip[row]):
            seg, span = state_span(table, h, offset, states[row].size)
            arena[seg, span] = states[row].reshape(-1).view(np.uint32)
    return arena


def read_states(arena, table, handles, offset, shape):
    """The valid rows' f32 states ``shape`` in ``arena`` (padding rows: None) and a bool mask
    of every other word."""
    other = np.ones(arena.shape, bool)
    out = []
    for h in handles:
        if h < 0:
            out.append(None)
            continue
        seg, span = state_span(table, h, offset, int(np.prod(shape)))
        out.append(arena[seg, span].view(np.float32).reshape(shape))
        other[seg, span] = False
    return out, other


# ---------------------------------------------------------------- the verify checks (XLA, f64)


def check_verify(parents, hk, hv, dk, dv, dtype, l2, decay="mild", seed=0, blocks=None):
    """The dense verify kernel on random inputs against float64 and the XLA path; returns
    ``(inputs, (u, g_path), XLA tree cache)``."""
    q, k, v, g, beta, s0 = tree_inputs(parents, hk, hv, dk, dv, dtype, seed, decay)
    kw = dict(use_qk_l2norm=l2, interpret=True, blocks=blocks or pk.VerifyBlocks())
    o, u, g_path = pk.tree_verify(q, k, v, g, beta, jnp.asarray(parents), s0, **kw)
    b, n = parents.shape
    chex.assert_shape((o, u), (b, n, hv, dv))
    chex.assert_type((o, u, g_path), (dtype, jnp.float32, jnp.float32))
    chex.assert_tree_all_finite((o, u, g_path))
    ox, cx = tree_verify(q, k, v, g, beta, parents, s0, use_qk_l2norm=l2, impl="xla")
    o64, _ = tree64(q, k, v, g, beta, parents, s0, use_qk_l2norm=l2)
    real = parents >= -1
    tol = TOL[dtype]
    assert rel_err(np.asarray(o)[real], o64[real]) < tol
    assert rel_err(np.asarray(o)[real], np.asarray(ox)[real]) < tol
    assert rel_err(np.asarray(u)[real], np.asarray(cx.u)[real]) < 2e-5
    assert rel_err(g_path, cx.g_path) < 1e-6
    return (q, k, v, g, beta, s0), (u, g_path), cx


# ------------------------------------------ states in a uint32 arena (verify, commit, decode)

HK, HV, K, V = 1, 2, 16, 32  # the arena tree tests' heads and dims
SEGMENTS, WORDS, OFFSET = 5, 4096, 100  # arena of SEGMENTS x WORDS words; states OFFSET in
# handle -> (segment, word): scattered, unaligned places
TABLE = np.array([[4, 5], [1, 2000], [2, 17], [0, 301], [3, 1000]], np.int32)


def arena_tree_setup(seed, dtype, b=3, n=12):
    """A random tree batch, an arena of garbage words with each valid row's ``S0`` at its
    handle (row 1 is padding, handle -1), the table, the handles and the dense ``S0`` (zero
    for the padding row): ``(tree inputs, arena, table, handles, dense)``."""
    rng = np.random.default_rng(seed)
    cast = lambda x, dt=dtype: jnp.asarray(x, dt)
    q, k = (cast(rng.standard_normal((b, n, HK, K))) for _ in range(2))
    v = cast(rng.standard_normal((b, n, HV, V)))
    g = cast(-rng.uniform(0.01, 0.3, (b, n, HV)), jnp.float32)
    beta = cast(rng.uniform(0.2, 1.0, (b, n, HV)), jnp.float32)
    parents = np.stack([np.r_[-1, rng.integers(0, np.arange(1, n))] for _ in range(b)])
    s0 = rng.standard_normal((b, HV, K, V)).astype(np.float32)
    arena = rng.integers(0, 2**32, (SEGMENTS, WORDS), dtype=np.uint32)  # garbage everywhere
    table = TABLE[:4]
    handles = np.array([2, -1, 0], np.int32)[:b]
    place_states(arena, table, handles, s0, OFFSET)
    dense = s0.copy()
    dense[handles < 0] = 0.0  # a padding row reads a zero state
    return (q, k, v, g, beta, jnp.asarray(parents, jnp.int32)), arena, table, handles, dense
