"""Interpret-mode tests of every Pallas kernel against the gdn_jax XLA path and float64 numpy.

Shapes are tiny (interpret mode runs the kernel body op by op on the CPU): K, V in {16, 32},
N <= 16, a handful of hypothesis examples over random trees.
"""

from __future__ import annotations

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pallas_kernels as pk
from gdn_jax import chunk_gated_delta_rule, tree_commit, tree_verify
from tests.gdn_jax.reference import recurrent64, rel_err, tree64, tree_paths
from tests.gdn_jax.strategies import make_inputs, make_tree

TOL = {np.float32: 2e-5, jnp.bfloat16: 1e-2}  # bf16: output rounding
FIXED_TREE = np.array(
    [[-1, 0, 0, 1, 1, 2, -1, 6, 7, -2], [-1, 0, 1, 2, 3, 4, 5, 6, 7, 8]], np.int32
)


def _inputs(parents, hk, hv, dk, dv, dtype, seed=0, decay="mild"):
    b, n = parents.shape
    q, k, v, g, beta, s0 = make_inputs(
        np.random.default_rng(seed), b, n, hk, hv, dk, dv, decay=decay
    )
    cast = lambda x: jnp.asarray(x, dtype)
    return cast(q), cast(k), cast(v), jnp.asarray(g), jnp.asarray(beta), jnp.asarray(s0)


def _check_verify(parents, hk, hv, dk, dv, dtype, l2, decay="mild", seed=0, blocks=None):
    q, k, v, g, beta, s0 = _inputs(parents, hk, hv, dk, dv, dtype, seed, decay)
    o, u, g_path = pk.tree_verify(
        q, k, v, g, beta, jnp.asarray(parents), s0, use_qk_l2norm=l2, interpret=True,
        blocks=blocks or pk.VerifyBlocks(),
    )  # fmt: skip
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


@pytest.mark.parametrize(
    "hk, hv, dk, dv, dtype, l2",
    [(1, 2, 16, 16, np.float32, True), (2, 2, 16, 32, jnp.bfloat16, False)],
)
def test_tree_verify_fixed_tree(hk, hv, dk, dv, dtype, l2):
    """A forest with a padding node and a chain, grouped heads, K != V, bf16 inputs."""
    _check_verify(FIXED_TREE, hk, hv, dk, dv, dtype, l2)


@settings(max_examples=3, deadline=None)
@given(
    kind=st.sampled_from(["random", "forest", "padded", "star"]),
    n=st.sampled_from([5, 16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_tree_verify_random_trees(kind, n, seed):
    parents = make_tree(kind, n, np.random.default_rng(seed))[None]
    _check_verify(parents, 1, 2, 16, 16, np.float32, True, decay="mixed", seed=seed % 1000)


@pytest.mark.parametrize(
    "blocks",
    [
        pk.VerifyBlocks(mode="x3"),
        pk.VerifyBlocks(ancestors_input=True, block_v=16),
        pk.VerifyBlocks(depth_loop=False, refine_steps=0, output_precision="tf32"),
        pk.VerifyBlocks(refine_steps=2, inverse_precision="bf16", precision="bf16x3"),
    ],
    ids=["x3", "ancestors-input", "static-doubling", "bf16-inverse"],
)
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_tree_verify_variants(blocks, dtype):
    """Every VerifyBlocks variant gives the same O and U (chain + forest with padding)."""
    _check_verify(FIXED_TREE, 1, 2, 16, 32, dtype, True, blocks=blocks)


def test_tree_verify_precomputed_ancestors():
    """A precomputed ancestor mask (padded here from N 10 to 16) gives the same bits as the
    kernel's own; misuse raises ValueError."""
    q, k, v, g, beta, s0 = _inputs(FIXED_TREE, 1, 2, 16, 16, np.float32, seed=3)
    par = jnp.asarray(FIXED_TREE)
    bl = pk.VerifyBlocks(ancestors_input=True)
    run = lambda **kw: pk.tree_verify(q, k, v, g, beta, par, s0, use_qk_l2norm=True,
                                      interpret=True, **kw)  # fmt: skip
    mask = pk.ancestor_mask(par)
    for got, want in zip(run(blocks=bl, ancestors=mask), run(blocks=bl), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="ancestors"):
        run(blocks=bl, ancestors=mask[:, :5])
    with pytest.raises(ValueError, match="ancestors"):
        run(ancestors=mask)


def test_tree_verify_depth_loop_deep_chain():
    """A 40-node chain needs all six doublings of the depth-adaptive inverse."""
    parents = (np.arange(40, dtype=np.int32) - 1)[None]
    _check_verify(parents, 1, 1, 16, 16, np.float32, True, decay="mixed", seed=11)


def test_verify_blocks_reject_bad_knobs():
    for bad in (dict(mode="fast"), dict(precision="f64"), dict(inverse_precision="x3"),
                dict(output_precision="bf16"), dict(refine_steps=9)):
        with pytest.raises(ValueError, match="blocks."):
            pk.VerifyBlocks(**bad)


@pytest.mark.parametrize("gather", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_tree_commit_matches_path_state(dtype, gather):
    """Commit of the path to every depth equals the float64 state after that path."""
    hk, hv, dk, dv = 1, 2, 16, 16
    (q, k, v, g, beta, s0), (u, g_path), _ = _check_verify(
        FIXED_TREE, hk, hv, dk, dv, dtype, True
    )
    _, states64 = tree64(q, k, v, g, beta, FIXED_TREE, s0, use_qk_l2norm=True)
    leaves = [8, 9]  # row 0: node 8 under the second root (path 6, 7, 8); row 1: the chain
    paths = [tree_paths(FIXED_TREE[r])[leaves[r]] for r in range(2)]
    d = max(len(p) for p in paths)
    path = np.array([p + [0] * (d - len(p)) for p in paths], np.int32)
    for plen in (np.array([len(paths[0]), 0]), np.array([2, len(paths[1])])):
        got = pk.tree_commit(
            s0, k, u, g_path, jnp.asarray(path), jnp.asarray(plen), use_qk_l2norm=True,
            blocks=pk.CommitBlocks(gather=gather), interpret=True,
        )  # fmt: skip
        chex.assert_shape(got, s0.shape)
        for r in range(2):
            want = np.asarray(s0[r]) if plen[r] == 0 else states64[r, path[r, plen[r] - 1]]
            # bf16 keys: the float64 states see the same bf16 inputs; U (from the bf16 verify,
            # f32) and the split weights keep the commit at f32 level.
            assert rel_err(got[r], want) < 2e-5


def test_routes_match_xla():
    """``impl="pallas"`` goes through gdn_jax.pallas_routes (interpret mode on CPU)."""
    q, k, v, g, beta, s0 = _inputs(FIXED_TREE, 1, 2, 16, 16, np.float32, seed=3)
    o, cache = tree_verify(q, k, v, g, beta, FIXED_TREE, s0, use_qk_l2norm=True, impl="pallas")
    ox, cx = tree_verify(q, k, v, g, beta, FIXED_TREE, s0, use_qk_l2norm=True, impl="xla")
    real = FIXED_TREE >= -1
    assert rel_err(np.asarray(o)[real], np.asarray(ox)[real]) < 2e-5
    path, plen = np.array([[0, 1, 3], [0, 1, 2]], np.int32), np.array([3, 2], np.int32)
    s = tree_commit(s0, cache, path, plen, impl="pallas")
    sx = tree_commit(s0, cx, path, plen, impl="xla")
    assert rel_err(s, sx) < 2e-5


def test_snapshot_verify():
    q, k, v, g, beta, s0 = _inputs(FIXED_TREE, 1, 2, 16, 16, np.float32, seed=4)
    o, snaps = pk.snapshot_verify(
        q, k, v, g, beta, jnp.asarray(FIXED_TREE), s0, use_qk_l2norm=True, interpret=True
    )
    o64, states64 = tree64(q, k, v, g, beta, FIXED_TREE, s0, use_qk_l2norm=True)
    real = FIXED_TREE >= -1
    assert rel_err(np.asarray(o)[real], o64[real]) < 2e-5
    assert rel_err(np.asarray(snaps)[real], states64[real]) < 2e-5


@pytest.mark.parametrize("cu", [None, (0, 5, 30, 40)])
def test_chunk(cu):
    """Chunked prefill (chunk 16) vs the float64 recurrence, per sequence, with final states."""
    b, t = (2, 20) if cu is None else (1, 40)
    q, k, v, g, beta, _ = _inputs(np.zeros((b, t), np.int32), 1, 2, 16, 16, np.float32, seed=5)
    n_seq = b if cu is None else len(cu) - 1
    s0 = jnp.asarray(np.random.default_rng(6).normal(size=(n_seq, 2, 16, 16)), jnp.float32)
    cu_j = None if cu is None else jnp.asarray(cu, jnp.int32)
    o, final = pk.chunk_gated_delta_rule(
        q, k, v, g, beta, s0, use_qk_l2norm=True, chunk_size=16, cu_seqlens=cu_j, interpret=True
    )
    chex.assert_shape(o, (b, t, 2, 16))
    chex.assert_shape(final, s0.shape)
    bounds = (
        [(r, 0, t) for r in range(b)]
        if cu is None
        else [(0, a, e) for a, e in zip(cu, cu[1:], strict=False)]
    )
    for s, (r, a, e) in enumerate(bounds):
        sl = lambda x, r=r, a=a, e=e: np.asarray(x[r : r + 1, a:e])
        o64, s64 = recurrent64(*(sl(x) for x in (q, k, v, g, beta)), np.asarray(s0[s : s + 1]),
                               use_qk_l2norm=True)  # fmt: skip
        assert rel_err(o[r, a:e], o64[0]) < 2e-5
        assert rel_err(final[s], s64[0]) < 2e-5
    ox, fx = chunk_gated_delta_rule(
        q, k, v, g, beta, s0, use_qk_l2norm=True, chunk_size=16, cu_seqlens=cu_j, impl="xla"
    )
    assert rel_err(o, ox) < 2e-5 and rel_err(final, fx) < 2e-5


def test_limits_raise():
    q = jnp.zeros((1, 129, 1, 16))
    v = jnp.zeros((1, 129, 1, 16))
    g = jnp.zeros((1, 129, 1))
    s0 = jnp.zeros((1, 1, 16, 16))
    par = jnp.arange(129, dtype=jnp.int32)[None] - 1
    with pytest.raises(ValueError, match="at most 128 nodes"):
        pk.tree_verify(q, q, v, g, g, par, s0, interpret=True)
    with pytest.raises(ValueError, match="K: .*power of two"):
        q12 = q[:, :8, :, :12]
        pk.tree_verify(q12, q12, v[:, :8], g[:, :8], g[:, :8], par[:, :8], s0, interpret=True)
    with pytest.raises(ValueError, match="q: .*float32, bfloat16"):
        qi = jnp.zeros((1, 8, 1, 16), jnp.int32)
        pk.tree_verify(qi, qi, v[:, :8], g[:, :8], g[:, :8], par[:, :8], s0, interpret=True)


def test_gpu_limits_raise_before_lowering():
    """The GPU builds' shared-memory limits are ValueErrors naming the limit (no device needed)."""
    q = jnp.zeros((1, 65, 1, 16))
    v = jnp.zeros((1, 65, 1, 16))
    g = jnp.zeros((1, 65, 1))
    par = jnp.arange(65, dtype=jnp.int32)[None] - 1
    with pytest.raises(ValueError, match="x3-mode .* at most 64 nodes"):
        pk.tree_verify(q, q, v, g, g, par, jnp.zeros((1, 1, 16, 16)),
                       blocks=pk.VerifyBlocks(mode="x3"))  # fmt: skip


@pytest.mark.parametrize("final", [True, False])
def test_chunk_route_matches_xla(final):
    """``impl="pallas"`` of the chunked prefill goes to the three-kernel prefill (interpret)."""
    q, k, v, g, beta, _ = _inputs(np.zeros((1, 40), np.int32), 1, 2, 16, 16, np.float32, seed=8)
    cu = jnp.asarray([0, 7, 40], jnp.int32)
    s0 = jnp.asarray(np.random.default_rng(9).normal(size=(2, 2, 16, 16)), jnp.float32)
    kw = dict(use_qk_l2norm=True, chunk_size=16, cu_seqlens=cu, output_final_state=final)
    o, sf = chunk_gated_delta_rule(q, k, v, g, beta, s0, impl="pallas", **kw)
    ox, sx = chunk_gated_delta_rule(q, k, v, g, beta, s0, impl="xla", **kw)
    assert rel_err(o, ox) < 2e-5
    if final:
        assert rel_err(sf, sx) < 2e-5
    else:
        assert sf is None and sx is None


def test_auto_commit_route_thresholds():
    """``impl="auto"`` on GPU takes the Pallas commit only for N <= 64 and B x Hv >= 1024 rows
    (where the H200 timed it faster than XLA)."""
    import types

    import jax

    from gdn_jax.dispatch import AUTO_PALLAS
    from gdn_jax.pallas_routes import AUTO_COMMIT_MIN_ROWS

    def cache(b, n, hv):
        s = jax.ShapeDtypeStruct
        return types.SimpleNamespace(k=s((b, n, 16, 128), jnp.bfloat16),
                                     u=s((b, n, hv, 128), jnp.float32))  # fmt: skip

    fits = AUTO_PALLAS["tree_commit"]
    assert AUTO_COMMIT_MIN_ROWS == 1024
    assert fits(cache(64, 64, 32)) and fits(cache(16, 64, 64))
    assert not fits(cache(1, 64, 64)) and not fits(cache(16, 64, 32))
    assert not fits(cache(64, 128, 32))

