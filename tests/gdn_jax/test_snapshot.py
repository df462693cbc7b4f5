"""The snapshot baseline (a full state per node) agrees with tree WY and float64."""

from __future__ import annotations

import chex
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gdn_jax import snapshot_tree_commit, snapshot_tree_verify, tree_commit, tree_verify
from tests.gdn_jax.reference import rel_err, tree64, tree_paths
from tests.gdn_jax.strategies import head_shapes, make_inputs, trees


@settings(max_examples=20, deadline=None)
@given(tree=trees(), shapes=head_shapes(), seed=st.integers(0, 2**31 - 1))
def test_snapshot_verify_and_commit(tree, shapes, seed):
    hk, hv, dk, dv = shapes
    rng = np.random.default_rng(seed)
    n = tree.shape[0]
    q, k, v, g, beta, s0 = make_inputs(rng, 1, n, hk, hv, dk, dv, decay="mixed")
    o_s, snaps = snapshot_tree_verify(q, k, v, g, beta, tree[None], s0, use_qk_l2norm=True)
    chex.assert_shape(snaps, (1, n, hv, dk, dv))
    o_w, cache = tree_verify(q, k, v, g, beta, tree[None], s0, use_qk_l2norm=True)
    o64, st64 = tree64(q, k, v, g, beta, tree[None], s0, use_qk_l2norm=True)
    real = tree >= -1
    assert rel_err(np.asarray(o_s)[0, real], o64[0, real]) < 2e-4
    assert rel_err(np.asarray(snaps)[0, real], st64[0, real]) < 2e-4
    assert rel_err(np.asarray(o_s)[0, real], np.asarray(o_w)[0, real]) < 2e-4
    node = int(rng.choice(np.nonzero(real)[0]))
    path = tree_paths(tree)[node]
    arr = np.full((1, n), -1, np.int32)
    arr[0, : len(path)] = path
    for m in (0, len(path)):
        plen = np.array([m], np.int32)
        a = snapshot_tree_commit(s0, snaps, arr, plen)
        b = tree_commit(s0, cache, arr, plen)
        assert rel_err(a, b) < 2e-4 if m else np.array_equal(a, s0)


# (Hk, Hv, K, V) the kernel takes: power-of-two head dims from 16, grouped heads, K != V
KERNEL_SHAPES = [(1, 2, 16, 32), (2, 2, 32, 16)]


@settings(max_examples=6, deadline=None)
@given(tree=trees(), shapes=st.sampled_from(KERNEL_SHAPES), seed=st.integers(0, 2**31 - 1))
def test_snapshot_impls_agree(tree, shapes, seed):
    """The fused kernel (``impl="pallas"``, interpret mode here) and the XLA loop give the same
    outputs and per-node states, both at float64's."""
    hk, hv, dk, dv = shapes
    rng = np.random.default_rng(seed)
    n = tree.shape[0]
    q, k, v, g, beta, s0 = make_inputs(rng, 2, n, hk, hv, dk, dv, decay="mixed")
    parents = np.stack([tree, tree])
    o64, st64 = tree64(q, k, v, g, beta, parents, s0, use_qk_l2norm=True)
    real = tree >= -1
    outs = {
        impl: snapshot_tree_verify(q, k, v, g, beta, parents, s0, use_qk_l2norm=True, impl=impl)
        for impl in ("xla", "pallas")
    }
    for impl, (o, snaps) in outs.items():
        chex.assert_shape(snaps, (2, n, hv, dk, dv))
        chex.assert_type(snaps, np.float32)
        assert rel_err(np.asarray(o)[:, real], o64[:, real]) < 2e-4, impl
        assert rel_err(np.asarray(snaps)[:, real], st64[:, real]) < 2e-4, impl


def test_snapshot_impl_checked():
    rng = np.random.default_rng(0)
    q, k, v, g, beta, s0 = make_inputs(rng, 1, 3, 1, 2, 16, 16, decay="mixed")
    parents = np.array([[-1, 0, 0]])
    with pytest.raises(ValueError, match="impl"):
        snapshot_tree_verify(q, k, v, g, beta, parents, s0, impl="triton")
    q, k, v, g, beta, s0 = make_inputs(rng, 1, 3, 1, 2, 4, 4, decay="mixed")
    with pytest.raises(ValueError, match="K: the Pallas kernels need a power of two"):
        snapshot_tree_verify(q, k, v, g, beta, parents, s0, impl="pallas")
