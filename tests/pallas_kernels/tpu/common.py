"""Inputs, float64 checks and an aligned arena for the TPU kernel tests (TPU interpret mode:
tiny shapes; the Mosaic lowering at real dims is checked without running)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import tpu
from tests.gdn_jax.reference import rel_err, tree64
from tests.pallas_kernels.common import place_states, read_states, tree_inputs

F32_TOL = 1e-4  # every TPU kernel against float64, f32 inputs
BF16_O_TOL = 1e-2  # bf16 outputs: their own rounding
# A forest (two roots) with a padding node, and a chain.
TREE = np.array([[-1, 0, 0, 1, 1, 2, -1, 6, 7, -2], [-1, 0, 1, 2, 3, 4, 5, 6, 7, 8]], np.int32)

# The arena kernels address 128-word lane rows: V = 128, states on 128-word boundaries.
HK, HV, K, V = 1, 2, 16, 128
SEGMENTS, WORDS, OFFSET = 4, 8192, 256
TABLE = np.array([[3, 128 * 5], [1, 0], [2, 128 * 20], [0, 128 * 3]], np.int32)
HANDLES = np.array([2, -1, 0], np.int32)  # row 1 is padding


def verify(parents, hk, hv, dk, dv, dtype, *, seed=0, decay="mixed", blocks=None):
    """The TPU verify on random inputs, checked against float64 and the XLA path; returns the
    inputs, ``(o, u, g_path)`` and the float64 per-node states."""
    from gdn_jax import tree_verify as op

    q, k, v, g, beta, s0 = tree_inputs(parents, hk, hv, dk, dv, dtype, seed, decay)
    blocks = blocks or tpu.TpuVerifyBlocks()
    par = jnp.asarray(parents)
    o, u, gp = tpu.tree_verify(
        q, k, v, g, beta, par, s0, use_qk_l2norm=True, blocks=blocks, interpret=True
    )
    o64, states64 = tree64(q, k, v, g, beta, parents, s0, use_qk_l2norm=True)
    ox, cx = op(q, k, v, g, beta, parents, s0, use_qk_l2norm=True, impl="xla")
    real = parents >= -1
    o_tol = F32_TOL if dtype == np.float32 else BF16_O_TOL
    assert o.dtype == v.dtype and u.dtype == gp.dtype == jnp.float32
    assert np.isfinite(np.asarray(o, np.float32)).all() and np.isfinite(np.asarray(u)).all()
    assert rel_err(np.asarray(o, np.float32)[real], o64[real]) < o_tol
    assert rel_err(np.asarray(u)[real], np.asarray(cx.u)[real]) < F32_TOL
    assert rel_err(np.asarray(gp)[real], np.asarray(cx.g_path)[real]) < 1e-6
    return (q, k, v, g, beta, s0), (o, u, gp), states64


def arena_with(states, rng):
    """A garbage-filled ``uint32 [SEGMENTS, WORDS]`` arena holding each valid row's state at
    its handle, and the dense states a kernel should see (zeros for the padding row)."""
    states = np.asarray(states, np.float32)
    arena = rng.integers(0, 2**32, (SEGMENTS, WORDS), dtype=np.uint32)
    place_states(arena, TABLE, HANDLES, states, OFFSET)
    dense = states.copy()
    dense[HANDLES < 0] = 0.0
    return arena, dense


def arena_operands(arena):
    """``(arena, table, handles)`` of an arena kernel call: ``arena`` from :func:`arena_with`,
    the test table and handles."""
    return jnp.asarray(arena), jnp.asarray(TABLE), jnp.asarray(HANDLES)


def assert_arena_states(out, arena, want):
    """The arena ``out`` an arena kernel returned holds ``want[b]`` bit for bit at each valid
    row's state, and every other word as in the ``arena`` it was given."""
    states, other = read_states(np.asarray(out), TABLE, HANDLES, OFFSET, (HV, K, V))
    for r, s in enumerate(states):
        if s is not None:
            np.testing.assert_array_equal(s, np.asarray(want[r]))
    np.testing.assert_array_equal(np.asarray(out)[other], arena[other])


def lowers(fn, *shapes, device_kind="TPU v5 lite") -> bool:
    """Whether ``fn`` lowers to Mosaic for a TPU (one ``tpu_custom_call`` at least)."""
    return "tpu_custom_call" in tpu.lower_for_tpu(fn, *shapes, device_kind=device_kind)


def shapes(*specs):
    return [jax.ShapeDtypeStruct(s, d) for s, d in specs]


def arena_shapes(b: int):
    """Abstract ``(arena, table, handles)`` for the lowering checks: a lane-row arena, eight
    handles' table entries and ``b`` handles."""
    return shapes(((4, 1024, 128), jnp.uint32), ((8, 2), jnp.int32), ((b,), jnp.int32))
