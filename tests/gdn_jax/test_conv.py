"""Short causal conv: HF semantics on sequences, on trees, and commit."""

from __future__ import annotations

import chex
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gdn_jax import causal_conv1d, causal_conv1d_update, tree_causal_conv1d, tree_conv_commit
from tests.gdn_jax.reference import causal_conv64, tree_paths
from tests.gdn_jax.strategies import make_tree, trees


def _data(rng, b, t, c, w):
    return (
        rng.normal(size=(b, t, c)).astype(np.float32),
        rng.normal(size=(c, w)).astype(np.float32),
        rng.normal(size=(b, w - 1, c)).astype(np.float32),
    )


@pytest.mark.parametrize("width", [2, 4])
def test_prefill_and_steps_match_float64(width):
    rng = np.random.default_rng(0)
    x, w, state = _data(rng, 2, 9, 5, width)
    y, new_state = causal_conv1d(x, w)
    np.testing.assert_allclose(y, causal_conv64(x, w), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(new_state, x[:, -(width - 1) :])
    y2, _ = causal_conv1d(x, w, state, activation=None)
    np.testing.assert_allclose(y2, causal_conv64(x, w, state, silu=False), rtol=1e-5, atol=1e-5)
    # decode token by token equals the prefill over the whole sequence
    s = state
    for t in range(x.shape[1]):
        yt, s = causal_conv1d_update(x[:, t], s, w)
        np.testing.assert_allclose(
            yt, causal_conv64(x[:, : t + 1], w, state)[:, -1], rtol=1e-5, atol=1e-5
        )
    chex.assert_shape(s, state.shape)


@settings(max_examples=30, deadline=None)
@given(tree=trees(), width=st.sampled_from([2, 4]), seed=st.integers(0, 2**31 - 1))
def test_tree_conv_equals_conv_along_each_path(tree, width, seed):
    rng = np.random.default_rng(seed)
    n = tree.shape[0]
    x, w, state = _data(rng, 1, n, 3, width)
    y = np.asarray(tree_causal_conv1d(x, tree[None], state, w))
    chex.assert_tree_all_finite(y)
    for node, path in enumerate(tree_paths(tree)):
        if path:
            want = causal_conv64(x[:, path], w, state)[:, -1]
            np.testing.assert_allclose(y[:, node], want, rtol=1e-5, atol=1e-5)
            # commit after every prefix of this path equals the state after the prefix
            for m in range(len(path) + 1):
                pth = np.full((1, n), -1, np.int32)
                pth[0, : len(path)] = path
                got = tree_conv_commit(x, state, pth, np.array([m], np.int32))
                full = np.concatenate([state, x[:, path[:m]]], 1)
                np.testing.assert_array_equal(got, full[:, -(width - 1) :])


def test_conv_errors():
    rng = np.random.default_rng(1)
    x, w, state = _data(rng, 2, 4, 3, 4)
    par = np.stack([make_tree("chain", 4, rng)] * 2)
    with pytest.raises(ValueError, match="^weight: "):
        causal_conv1d(x, w[:2])
    with pytest.raises(ValueError, match="^conv_state: "):
        causal_conv1d(x, w, state[:, :2])
    with pytest.raises(ValueError, match="^x: "):
        causal_conv1d(x[0], w)
    with pytest.raises(ValueError, match="^activation: "):
        causal_conv1d(x, w, activation="gelu")
    with pytest.raises(ValueError, match="^x: expected \\[B, C\\]"):
        causal_conv1d_update(x, state, w)
    with pytest.raises(ValueError, match="must be < its own index"):
        tree_causal_conv1d(x, np.array([[-1, 1, 0, 0]] * 2), state, w)
    with pytest.raises(ValueError, match="^parents: "):
        tree_causal_conv1d(x, par[:, :3], state, w)
    with pytest.raises(ValueError, match="^x: "):
        tree_conv_commit(x[:1], state, np.zeros((2, 2), np.int32), np.ones(2, np.int32))
    with pytest.raises(ValueError, match="path"):
        tree_conv_commit(x, state, np.zeros((2,), np.int32), np.ones(2, np.int32))
