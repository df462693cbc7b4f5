"""The commit kernels (``pallas_kernels.commit``, interpret mode): the dense kernel
(``kernel.py``) after a verify against the float64 state at the path's end and against
``commit/reference.py``; the arena kernel (``arena.py``) in verify -> commit round trips through
a uint32 arena (bit for bit the dense kernels, no other arena word changed) and against its
reference; and ``commit/reference.py`` itself against the float64 per-path recurrence."""

from __future__ import annotations

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pallas_kernels as pk
from pallas_kernels.commit import arena as commit_arena
from pallas_kernels.commit.reference import tree_commit_arena_reference, tree_commit_reference
from pallas_kernels.verify import arena as verify_arena
from pallas_kernels.verify.reference import tree_verify_reference
from tests.gdn_jax.reference import rel_err, tree64, tree_paths
from tests.gdn_jax.strategies import head_shapes, trees
from tests.pallas_kernels.common import (
    FIXED_TREE,
    HK,
    HV,
    OFFSET,
    K,
    V,
    arena_tree_setup,
    check_verify,
    read_states,
    tree_inputs,
)


def _padded_paths(paths):
    """int32 ``[B, D]`` of root-to-leaf paths padded with node 0."""
    d = max(len(p) for p in paths)
    return np.array([p + [0] * (d - len(p)) for p in paths], np.int32)


@pytest.mark.parametrize("gather", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_matches_path_state(dtype, gather):
    """Commit of the path to every depth equals the float64 state after that path."""
    (q, k, v, g, beta, s0), (u, g_path), _ = check_verify(FIXED_TREE, 1, 2, 16, 16, dtype, True)
    _, states64 = tree64(q, k, v, g, beta, FIXED_TREE, s0, use_qk_l2norm=True)
    leaves = [8, 9]  # row 0: node 8 under the second root (path 6, 7, 8); row 1: the chain
    paths = [tree_paths(FIXED_TREE[r])[leaves[r]] for r in range(2)]
    path = _padded_paths(paths)
    kw = dict(use_qk_l2norm=True, blocks=pk.CommitBlocks(gather=gather), interpret=True)
    for plen in (np.array([len(paths[0]), 0]), np.array([2, len(paths[1])])):
        got = pk.tree_commit(s0, k, u, g_path, jnp.asarray(path), jnp.asarray(plen), **kw)
        chex.assert_shape(got, s0.shape)
        for r in range(2):
            want = np.asarray(s0[r]) if plen[r] == 0 else states64[r, path[r, plen[r] - 1]]
            # bf16 keys: the float64 states see the same bf16 inputs; U (from the bf16 verify,
            # f32) and the split weights keep the commit at f32 level.
            assert rel_err(got[r], want) < 2e-5


def _commit_inputs(rng, b, n, d, hk, hv, dk, dv, dtype):
    """Random commit inputs (never zero): ``S0``, keys, ``u``, decreasing-ish ``g_path``, and
    distinct path nodes with lengths 0..d."""
    s0 = jnp.asarray(rng.standard_normal((b, hv, dk, dv)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, n, hk, dk)), dtype)
    u = jnp.asarray(rng.standard_normal((b, n, hv, dv)), jnp.float32)
    g_path = jnp.asarray(-rng.uniform(0.0, 3.0, (b, n, hv)), jnp.float32)
    path = np.stack([rng.permutation(n)[:d] for _ in range(b)]).astype(np.int32)
    path_len = rng.integers(0, d + 1, b).astype(np.int32)
    return s0, k, u, g_path, jnp.asarray(path), jnp.asarray(path_len)


@settings(max_examples=4, deadline=None)
@given(
    b=st.integers(1, 3),
    n=st.sampled_from([5, 16]),
    dtype=st.sampled_from([np.float32, jnp.bfloat16]),
    gather=st.booleans(),
    l2=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_reference(b, n, dtype, gather, l2, seed):
    """The dense kernel equals ``commit/reference.py`` on random paths (empty ones included)."""
    rng = np.random.default_rng(seed)
    args = _commit_inputs(rng, b, n, min(n, 4), 1, 2, 16, 32, dtype)
    got = pk.tree_commit(
        *args, use_qk_l2norm=l2, blocks=pk.CommitBlocks(gather=gather), interpret=True
    )
    want = tree_commit_reference(*args, use_qk_l2norm=l2)
    chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
    assert rel_err(got, want) < 2e-5


@settings(max_examples=6, deadline=None)
@given(
    parents=trees(kinds=("chain", "random", "forest", "padded")),
    heads=head_shapes(),
    l2=st.booleans(),
    seed=st.integers(0, 999),
)
def test_reference_matches_float64(parents, heads, l2, seed):
    """``commit/reference.py`` after ``verify/reference.py``: committing the path to any node
    gives the float64 state at that node, the empty path leaves ``S0``."""
    par = parents[None]
    inputs = tree_inputs(par, *heads, np.float32, seed=seed, decay="mixed")
    q, k, v, g, beta, s0 = inputs
    _, u, g_path = tree_verify_reference(q, k, v, g, beta, jnp.asarray(par), s0, use_qk_l2norm=l2)
    _, states64 = tree64(q, k, v, g, beta, par, s0, use_qk_l2norm=l2)
    paths = tree_paths(parents)
    real = [i for i, p in enumerate(paths) if p]
    rows = len(real) + 1  # every real node's path, then the empty path, one row each
    path = _padded_paths([paths[i] for i in real] + [[]])
    path_len = np.array([len(paths[i]) for i in real] + [0], np.int32)
    tile = lambda x: jnp.broadcast_to(x, (rows, *x.shape[1:]))
    got = tree_commit_reference(
        tile(s0), tile(k), tile(u), tile(g_path), path, path_len, use_qk_l2norm=l2
    )
    assert rel_err(np.asarray(got)[:-1], states64[0, real]) < 1e-5
    np.testing.assert_allclose(np.asarray(got)[-1], np.asarray(s0[0]), rtol=1e-6)


def _assert_arena_commit(new, arena, table, handles, want, offset):
    """Each valid row's state in ``new`` is ``want[row]`` bit for bit; every other word is
    ``arena``'s."""
    got, untouched = read_states(new, table, handles, offset, (HV, K, V))
    for row, s in enumerate(got):
        if s is not None:
            np.testing.assert_array_equal(s, want[row])
    np.testing.assert_array_equal(new[untouched], arena[untouched])


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_arena_round_trip_matches_dense(dtype):
    """Verify then commit through the arena equal the dense kernels bit for bit."""
    tree, arena, table, handles, dense = arena_tree_setup(0, dtype)
    q, k, v, g, beta, parents = tree
    addr = (jnp.asarray(arena), jnp.asarray(table), jnp.asarray(handles))
    kw = dict(use_qk_l2norm=True, interpret=True)
    o, u, gp = verify_arena.tree_verify(*tree, *addr, state_offset=OFFSET, **kw)
    od, ud, gd = pk.tree_verify(*tree, jnp.asarray(dense), **kw)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(od))
    np.testing.assert_array_equal(np.asarray(u), np.asarray(ud))
    np.testing.assert_array_equal(np.asarray(gp), np.asarray(gd))

    path = jnp.asarray([[0, 1], [0, 0], [0, 2]], jnp.int32)
    path_len = jnp.asarray([2, 1, 1], jnp.int32)
    commit = (k, u, gp, path, path_len)
    new = commit_arena.tree_commit(*addr, *commit, state_offset=OFFSET, **kw)
    want = pk.tree_commit(jnp.asarray(dense), k, ud, gd, path, path_len, **kw)
    _assert_arena_commit(np.asarray(new), arena, table, handles, np.asarray(want), OFFSET)


@settings(max_examples=4, deadline=None)
@given(
    b=st.integers(1, 3),
    n=st.sampled_from([5, 16]),
    offset=st.integers(0, 64),
    seed=st.integers(0, 2**31 - 1),
)
def test_arena_round_trip_random_placements(b, n, offset, seed):
    """Random rows, tree sizes, offsets and unit placements (one unit per segment, anywhere in
    it; some rows padding): the arena kernels equal the dense kernels bit for bit, and every
    word outside the committed states is unchanged."""
    rng = np.random.default_rng(seed)
    units = HV * K * V
    words = units + offset + 200
    segs = b + 2
    arena = rng.integers(0, 2**32, (segs, words), dtype=np.uint32)
    table = np.stack([rng.permutation(segs)[: b + 1], rng.integers(0, 200, b + 1)], 1)
    handles = rng.permutation(b + 1)[:b].astype(np.int32)
    handles[rng.random(b) < 0.3] = -1
    q, k = (jnp.asarray(rng.standard_normal((b, n, HK, K)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((b, n, HV, V)), jnp.float32)
    g = jnp.asarray(-rng.uniform(0.01, 1.0, (b, n, HV)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.1, 1.0, (b, n, HV)), jnp.float32)
    parents = np.stack([np.r_[-1, rng.integers(0, np.arange(1, n))] for _ in range(b)])
    dense = rng.standard_normal((b, HV, K, V)).astype(np.float32)
    dense[handles < 0] = 0.0
    for row, h in enumerate(handles):
        if h >= 0:
            seg, word = table[h]
            arena[seg, word + offset : word + offset + units] = dense[row].view(np.uint32).ravel()
    tree = (q, k, v, g, beta, jnp.asarray(parents, jnp.int32))
    addr = (jnp.asarray(arena), jnp.asarray(table, jnp.int32), jnp.asarray(handles))
    kw = dict(use_qk_l2norm=True, interpret=True)
    o, u, gp = verify_arena.tree_verify(*tree, *addr, state_offset=offset, **kw)
    od, ud, gd = pk.tree_verify(*tree, jnp.asarray(dense), **kw)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(od))
    np.testing.assert_array_equal(np.asarray(u), np.asarray(ud))
    # node 1's parent is always node 0, so [0, 1] is a root path; commit 0, 1 or 2 of it
    path = jnp.asarray(np.tile([0, 1], (b, 1)), jnp.int32)
    path_len = jnp.asarray(rng.integers(0, 3, b), jnp.int32)
    new = commit_arena.tree_commit(*addr, k, u, gp, path, path_len, state_offset=offset, **kw)
    want = pk.tree_commit(jnp.asarray(dense), k, ud, gd, path, path_len, **kw)
    _assert_arena_commit(np.asarray(new), arena, table, handles, np.asarray(want), offset)


def test_arena_matches_reference():
    """The arena kernel equals ``tree_commit_arena_reference``: the valid rows' states to f32
    level, every other word (the padding row's unit too) unchanged."""
    _, arena, table, handles, _ = arena_tree_setup(3, np.float32)
    rng = np.random.default_rng(3)
    _, k, u, g_path, path, path_len = _commit_inputs(rng, 3, 12, 4, HK, HV, K, V, np.float32)
    addr = (jnp.asarray(arena), jnp.asarray(table), jnp.asarray(handles))
    args = (k, u, g_path, path, path_len)
    kw = dict(state_offset=OFFSET, use_qk_l2norm=True)
    got = np.asarray(commit_arena.tree_commit(*addr, *args, interpret=True, **kw))
    want = np.asarray(tree_commit_arena_reference(*addr, *args, **kw))
    states, other = read_states(got, table, handles, OFFSET, (HV, K, V))
    states_r, _ = read_states(want, table, handles, OFFSET, (HV, K, V))
    for s, s_r in zip(states, states_r, strict=True):
        if s is not None:
            assert rel_err(s, s_r) < 2e-5
    np.testing.assert_array_equal(got[other], want[other])
    np.testing.assert_array_equal(got[other], arena[other])
