"""The TPU commit (``pallas_kernels.tpu.commit``) in TPU interpret mode: after a TPU verify,
the committed state against the float64 state at the path's end (every depth, an empty path,
bf16 keys); the arena variant in place (bit for bit the dense kernel, no other word touched);
and the Mosaic lowering."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import tpu
from tests.gdn_jax.reference import rel_err, tree_paths
from tests.pallas_kernels.tpu.common import (
    F32_TOL,
    HK,
    HV,
    OFFSET,
    TREE,
    K,
    V,
    arena_operands,
    arena_shapes,
    arena_with,
    assert_arena_states,
    lowers,
    shapes,
    verify,
)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_matches_path_state(dtype):
    """Commit of a path to several depths (0 included) equals the float64 state there."""
    (q, k, v, g, beta, s0), (_, u, gp), states64 = verify(TREE, 1, 2, 16, 16, dtype, decay="mild")
    paths = [tree_paths(TREE[0])[8], tree_paths(TREE[1])[9]]  # 6 -> 7 -> 8, and the chain
    path = np.array([p + [0] * (10 - len(p)) for p in paths], np.int32)
    for plen in (np.array([3, 0]), np.array([2, 10])):
        got = tpu.tree_commit(
            s0, k, u, gp, jnp.asarray(path), jnp.asarray(plen), use_qk_l2norm=True, interpret=True
        )
        for r in range(2):
            want = np.asarray(s0[r]) if plen[r] == 0 else states64[r, path[r, plen[r] - 1]]
            assert rel_err(got[r], want) < F32_TOL


def test_arena_in_place():
    """The arena commit writes each valid row's new state where it read it (the padding row
    writes nothing), equal to the dense commit bit for bit; no other word changes."""
    rng = np.random.default_rng(2)
    b, n = 3, 9
    k = jnp.asarray(rng.standard_normal((b, n, HK, K)), jnp.bfloat16)
    u = jnp.asarray(rng.standard_normal((b, n, HV, V)), jnp.float32)
    gp = jnp.asarray(-rng.uniform(0, 3, (b, n, HV)), jnp.float32)
    path = jnp.asarray(np.array([[0, 2, 5], [1, 3, 4], [0, 1, 2]], np.int32))
    plen = jnp.asarray(np.array([3, 2, 0], np.int32))
    arena, dense = arena_with(rng.standard_normal((b, HV, K, V)), rng)
    out = tpu.tree_commit_arena(
        *arena_operands(arena), k, u, gp, path, plen,
        state_offset=OFFSET, use_qk_l2norm=True, interpret=True,
    )  # fmt: skip
    want = tpu.tree_commit(
        jnp.asarray(dense), k, u, gp, path, plen, use_qk_l2norm=True, interpret=True
    )
    assert_arena_states(out, arena, want)


def test_lowers():
    b, n, hk, hv, d = 4, 64, 2, 4, 128
    f = jnp.float32
    args = shapes(
        ((b, hv, d, d), f),
        ((b, n, hk, d), jnp.bfloat16),
        ((b, n, hv, d), f),
        ((b, n, hv), f),
        ((b, 7), jnp.int32),
        ((b,), jnp.int32),
    )
    assert lowers(lambda *a: tpu.tree_commit(*a, use_qk_l2norm=True), *args)
    fn = lambda *a: tpu.tree_commit_arena(*a, state_offset=128, use_qk_l2norm=True)
    assert lowers(fn, *arena_shapes(b), *args[1:])
