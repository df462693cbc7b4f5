"""Tree WY verify and commit against float64 sequential recurrence along every node's path."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gdn_jax import (
    DraftTree,
    TreeCache,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
    tree_commit,
    tree_verify,
)
from tests.gdn_jax.reference import recurrent64, rel_err, tree64, tree_paths
from tests.gdn_jax.strategies import head_shapes, make_inputs, make_tree, trees

SETTINGS = settings(max_examples=30, deadline=None)


def _verify_and_check(parents, shapes, decay, dtype, l2, seed):
    hk, hv, dk, dv = shapes
    b, n = parents.shape
    rng = np.random.default_rng(seed)
    q, k, v, g, beta, s0 = make_inputs(rng, b, n, hk, hv, dk, dv, decay=decay, dtype=dtype)
    o, cache = tree_verify(q, k, v, g, beta, parents, s0, use_qk_l2norm=l2)
    chex.assert_shape(o, (b, n, hv, dv))
    chex.assert_type(o, dtype)
    chex.assert_shape(cache.u, (b, n, hv, dv))
    chex.assert_tree_all_finite((o, cache))
    o64, states64 = tree64(q, k, v, g, beta, parents, s0, use_qk_l2norm=l2)
    real = parents >= -1
    tol = 2e-4 if dtype == np.float32 else 1e-2  # bf16 output rounding
    assert rel_err(np.asarray(o, np.float64)[real], o64[real]) < tol
    return (q, k, v, g, beta, s0), cache, states64


@SETTINGS
@given(
    tree=trees(),
    batch=st.integers(1, 2),
    shapes=head_shapes(),
    decay=st.sampled_from(["mild", "strong", "mixed"]),
    dtype=st.sampled_from([np.float32, jnp.bfloat16]),
    l2=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_verify_matches_path_recurrence(tree, batch, shapes, decay, dtype, l2, seed):
    """Every node's output equals float64 sequential recurrence along its own path."""
    parents = np.stack([tree] * batch)
    _verify_and_check(parents, shapes, decay, dtype, l2, seed)


@SETTINGS
@given(
    n=st.sampled_from([4, 9, 16]),
    kinds=st.lists(
        st.sampled_from(["chain", "star", "random", "forest", "padded"]), min_size=2, max_size=2
    ),
    shapes=head_shapes(),
    decay=st.sampled_from(["mild", "strong"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_commit_equals_state_after_every_prefix(n, kinds, shapes, decay, seed):
    """``tree_commit`` equals the recurrent state after the accepted chain, for every prefix
    length of a random root-to-node path, ``path_len == 0`` included (state returned as is)."""
    rng = np.random.default_rng(seed)
    parents = np.stack([make_tree(kind, n, rng) for kind in kinds])
    (q, k, v, g, beta, s0), cache, states64 = _verify_and_check(
        parents, shapes, decay, np.float32, True, seed
    )
    d = n
    nodes = [int(rng.choice(np.nonzero(p >= -1)[0])) for p in parents]
    paths = [tree_paths(p)[nd] for p, nd in zip(parents, nodes, strict=True)]
    path = np.full((2, d), -1, np.int32)
    for r, p in enumerate(paths):
        path[r, : len(p)] = p
    for m in range(max(len(p) for p in paths) + 1):
        plen = np.array([min(m, len(p)) for p in paths], np.int32)
        s_new = tree_commit(s0, cache, path, plen)
        chex.assert_shape(s_new, s0.shape)
        for r in range(2):
            if plen[r] == 0:
                np.testing.assert_array_equal(np.asarray(s_new[r]), s0[r])
            else:
                want = states64[r, path[r, plen[r] - 1]]
                assert rel_err(s_new[r], want) < 2e-4


@SETTINGS
@given(
    t=st.sampled_from([1, 7, 16, 40]),
    shapes=head_shapes(),
    decay=st.sampled_from(["mild", "strong", "mixed"]),
    chunk=st.sampled_from([4, 16, 64]),
    seed=st.integers(0, 2**31 - 1),
)
def test_chain_tree_equals_chunk_equals_recurrent(t, shapes, decay, chunk, seed):
    hk, hv, dk, dv = shapes
    rng = np.random.default_rng(seed)
    q, k, v, g, beta, s0 = make_inputs(rng, 2, t, hk, hv, dk, dv, decay=decay)
    chain = np.broadcast_to(np.arange(-1, t - 1, dtype=np.int32), (2, t))
    o_tree, cache = tree_verify(q, k, v, g, beta, chain, s0, use_qk_l2norm=True)
    o_chunk, s_chunk = chunk_gated_delta_rule(
        q, k, v, g, beta, s0, use_qk_l2norm=True, chunk_size=chunk
    )
    o_rec, s_rec = recurrent_gated_delta_rule(q, k, v, g, beta, s0, use_qk_l2norm=True)
    o64, s64 = recurrent64(q, k, v, g, beta, s0, use_qk_l2norm=True)
    for o in (o_tree, o_chunk, o_rec):
        assert rel_err(o, o64) < 2e-4
    path = np.broadcast_to(np.arange(t, dtype=np.int32), (2, t))
    s_commit = tree_commit(s0, cache, path, np.full(2, t, np.int32))
    for s in (s_commit, s_chunk, s_rec):
        assert rel_err(s, s64) < 2e-4


@SETTINGS
@given(
    tree=trees(kinds=("random", "forest", "padded", "star")),
    shapes=head_shapes(),
    seed=st.integers(0, 2**31 - 1),
)
def test_renumbering_permutes_outputs_only(tree, shapes, seed):
    """Another valid topological order of the same tree permutes outputs and nothing else."""
    n = tree.shape[0]
    rng = np.random.default_rng(seed)
    # A random topological order: repeatedly pick a random node whose parent is already placed.
    order, placed = [], set()
    while len(order) < n:
        ready = [i for i in range(n) if i not in placed and (tree[i] < 0 or tree[i] in placed)]
        pick = int(rng.choice(ready))
        order.append(pick)
        placed.add(pick)
    order = np.array(order)
    new_id = np.empty(n, np.int64)
    new_id[order] = np.arange(n)
    new_parents = np.where(
        tree[order] >= 0, new_id[np.maximum(tree[order], 0)], tree[order]
    ).astype(np.int32)
    hk, hv, dk, dv = shapes
    q, k, v, g, beta, s0 = make_inputs(rng, 1, n, hk, hv, dk, dv, decay="mixed")
    o1, c1 = tree_verify(q, k, v, g, beta, tree[None], s0, use_qk_l2norm=True)
    perm = lambda x: x[:, order]
    o2, c2 = tree_verify(
        perm(q), perm(k), perm(v), perm(g), perm(beta), new_parents[None], s0, use_qk_l2norm=True
    )
    real = tree[order] >= -1
    np.testing.assert_allclose(
        np.asarray(o2)[0, real], np.asarray(o1)[0, order][real], rtol=2e-5, atol=2e-5
    )
    np.testing.assert_allclose(
        np.asarray(c2.u)[0, real], np.asarray(c1.u)[0, order][real], rtol=2e-5, atol=2e-5
    )


def test_extreme_decay_deep_chain_is_finite_and_exact():
    """g = -30 on every token of a 128-deep chain: no overflow, no NaN (masked exp)."""
    n = 128
    rng = np.random.default_rng(0)
    q, k, v, g, beta, s0 = make_inputs(rng, 1, n, 2, 4, 8, 8, decay="strong")
    g[:] = -30.0
    chain = np.arange(-1, n - 1, dtype=np.int32)[None]
    o, cache = tree_verify(q, k, v, g, beta, chain, s0)
    chex.assert_tree_all_finite((o, cache))
    o64, _ = recurrent64(q, k, v, g, beta, s0)
    assert rel_err(o, o64) < 2e-4
    s = tree_commit(s0, cache, np.arange(n, dtype=np.int32)[None], np.array([n], np.int32))
    chex.assert_tree_all_finite(s)


def test_one_program_serves_every_topology():
    """Topology is data: several trees of the same N reuse one compiled program."""
    n = 12
    rng = np.random.default_rng(1)
    q, k, v, g, beta, s0 = make_inputs(rng, 2, n, 2, 4, 8, 8)
    verify = jax.jit(tree_verify, static_argnames=("use_qk_l2norm",))
    commit = jax.jit(tree_commit)
    for kind in ("chain", "star", "random", "forest", "padded", "random"):
        parents = np.stack([make_tree(kind, n, rng), make_tree("random", n, rng)])
        o, cache = verify(q, k, v, g, beta, parents, s0, use_qk_l2norm=True)
        o64, _ = tree64(q, k, v, g, beta, parents, s0, use_qk_l2norm=True)
        real = parents >= -1
        assert rel_err(np.asarray(o)[real], o64[real]) < 2e-4
        path = np.zeros((2, 3), np.int32)
        commit(s0, cache, path, np.array([1, 0], np.int32))
    assert verify._cache_size() == 1
    assert commit._cache_size() == 1


def test_vmap_over_requests_matches_batch():
    n = 6
    rng = np.random.default_rng(2)
    q, k, v, g, beta, s0 = make_inputs(rng, 3, n, 1, 2, 4, 6)
    parents = np.stack([make_tree("random", n, rng) for _ in range(3)])
    o_b, c_b = tree_verify(q, k, v, g, beta, parents, s0)

    def one(q, k, v, g, beta, p, s):
        o, c = tree_verify(q[None], k[None], v[None], g[None], beta[None], p[None], s[None])
        s_new = tree_commit(s[None], c, jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32))
        return o[0], s_new[0]

    o_v, s_v = jax.vmap(one)(q, k, v, g, beta, parents, s0)
    np.testing.assert_allclose(o_v, o_b, rtol=1e-5, atol=1e-5)
    s_b = tree_commit(s0, c_b, np.zeros((3, 2), np.int32), np.ones(3, np.int32))
    np.testing.assert_allclose(s_v, s_b, rtol=1e-5, atol=1e-5)


def test_cache_is_a_pytree_with_static_flag():
    rng = np.random.default_rng(3)
    q, k, v, g, beta, s0 = make_inputs(rng, 1, 4, 1, 1, 4, 4)
    _, cache = tree_verify(q, k, v, g, beta, np.array([[-1, 0, 0, 1]]), s0, use_qk_l2norm=True)
    leaves, treedef = jax.tree_util.tree_flatten(cache)
    assert len(leaves) == 4
    again = jax.tree_util.tree_unflatten(treedef, leaves)
    assert isinstance(again, TreeCache) and again.qk_l2norm is True
    # U is one V-vector per node and value head, not a K x V state.
    assert cache.nbytes_per_node() < 4 * 4 * 4


# --- errors -----------------------------------------------------------------------------------


def _inputs(n=4, hk=2, hv=4):
    return make_inputs(np.random.default_rng(4), 1, n, hk, hv, 4, 4)


@pytest.mark.parametrize(
    ("parents", "match"),
    [
        ([[-1, 1, 0, 1]], r"parents\[0\]\[1\] = 1 must be < its own index"),
        ([[-1, 0, 7, 1]], r"parents\[0\]\[2\] = 7 is out of range"),
        ([[-1, 0, -3, 1]], r"parents\[0\]\[2\] = -3 is out of range"),
        ([[-1, -2, 1, 0]], r"is a padding node"),
        ([[-1, 0, 0]], r"parents: expected shape"),
    ],
)
def test_verify_rejects_bad_parents(parents, match):
    q, k, v, g, beta, s0 = _inputs()
    with pytest.raises(ValueError, match=match):
        tree_verify(q, k, v, g, beta, np.array(parents, np.int32), s0)


def test_verify_rejects_bad_shapes():
    q, k, v, g, beta, s0 = _inputs()
    par = np.array([[-1, 0, 0, 1]], np.int32)
    with pytest.raises(ValueError, match="multiple of key heads"):
        q3, k3, *_ = make_inputs(np.random.default_rng(0), 1, 4, 3, 3, 4, 4)
        tree_verify(q3, k3, v, g, beta, par, s0)
    with pytest.raises(ValueError, match="^q: "):
        tree_verify(q[..., :2], k, v, g, beta, par, s0)
    with pytest.raises(ValueError, match="^g: "):
        tree_verify(q, k, v, g[:, :3], beta, par, s0)
    with pytest.raises(ValueError, match="^beta: "):
        tree_verify(q, k, v, g, beta[..., :1], par, s0)
    with pytest.raises(ValueError, match="^initial_state: "):
        tree_verify(q, k, v, g, beta, par, s0[:, :, :2])
    with pytest.raises(ValueError, match="^v: "):
        tree_verify(q, k, v[:, :2], g, beta, par, s0)
    with pytest.raises(ValueError, match="^impl: "):
        tree_verify(q, k, v, g, beta, par, s0, impl="cuda")


def test_commit_rejects_paths_that_are_not_chains():
    q, k, v, g, beta, s0 = _inputs()
    par = np.array([[-1, 0, 0, 1]], np.int32)  # 0 -> {1, 2}, 1 -> 3
    _, cache = tree_verify(q, k, v, g, beta, par, s0)
    ok = tree_commit(s0, cache, np.array([[0, 1, 3]]), np.array([3]))
    chex.assert_tree_all_finite(ok)
    cases = [
        ([[0, 2, 3]], [3], "not a chain"),  # 3 is not a child of 2
        ([[1, 3, 0]], [2], "not a chain"),  # 1 is not a root
        ([[0, 5, 0]], [2], r"path\[0, 1\] = 5 is not a node id"),
        ([[0, 1, 3]], [4], r"path_len: every entry must be in \[0, 3\]"),
        ([[0, 1, 3]], [-1], "path_len"),
    ]
    for path, plen, match in cases:
        with pytest.raises(ValueError, match=match):
            tree_commit(s0, cache, np.array(path), np.array(plen))
    with pytest.raises(ValueError, match="^path: "):
        tree_commit(s0, cache, np.array([0, 1]), np.array([1]))
    with pytest.raises(ValueError, match="^path_len: "):
        tree_commit(s0, cache, np.array([[0, 1]]), np.array([1, 1]))
    with pytest.raises(ValueError, match="^initial_state: "):
        tree_commit(s0[:, :2], cache, np.array([[0, 1]]), np.array([1]))


def test_draft_tree_feeds_verify_and_commit():
    """The host-side builder produces the device inputs: parents, padding, commit paths."""
    tree = DraftTree.from_paths([[5, 6, 7], [5, 6, 8], [5, 9], [4]]).pad(8)
    parents = tree.parents[None]
    q, k, v, g, beta, s0 = make_inputs(np.random.default_rng(5), 1, 8, 1, 2, 4, 4)
    o, cache = tree_verify(q, k, v, g, beta, parents, s0)
    leaf = tree.leaves()[1]
    path, plen = tree.path_array(leaf, 4)
    s_new = tree_commit(s0, cache, path[None], np.array([plen]))
    p = tree.path(leaf)
    _, s64 = recurrent64(q[:, p], k[:, p], v[:, p], g[:, p], beta[:, p], s0)
    assert rel_err(s_new, s64) < 2e-4


def test_remaining_error_paths():
    """Every remaining host-visible ValueError: dtypes, cu_seqlens shape, path_array depth."""
    from gdn_jax import chunk_gated_delta_rule

    q, k, v, g, beta, s0 = _inputs()
    par = np.array([[-1, 0, 0, 1]], np.int32)
    with pytest.raises(ValueError, match="^k/v: must be floating point"):
        tree_verify(q, k.astype(np.int32), v, g, beta, par, s0)
    with pytest.raises(ValueError, match="^parents: must be integer"):
        tree_verify(q, k, v, g, beta, par.astype(np.float32), s0)
    _, cache = tree_verify(q, k, v, g, beta, par, s0)
    with pytest.raises(ValueError, match="^path: must be integer"):
        tree_commit(s0, cache, np.array([[0.0, 1.0]]), np.array([1]))
    with pytest.raises(ValueError, match="^path_len: must be integer"):
        tree_commit(s0, cache, np.array([[0, 1]]), np.array([1.0]))
    with pytest.raises(ValueError, match="^cu_seqlens: expected a 1-D array"):
        chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=np.array([4]))
    with pytest.raises(ValueError, match="^cu_seqlens: must be integer"):
        chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=np.array([0.0, 4.0]))
    with pytest.raises(ValueError, match="^max_depth: "):
        DraftTree.from_parents([-1, 0, 1]).path_array(2, 2)
