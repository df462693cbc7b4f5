"""DraftTree: construction, validation errors, depth, masks, padding, tries."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from gdn_jax import DraftTree, ancestor_closure
from tests.gdn_jax.reference import tree_paths
from tests.gdn_jax.strategies import trees


def test_from_parents_basics():
    t = DraftTree.from_parents([-1, 0, 0, 1, -1, 4])
    assert t.num_nodes == 6 and t.num_real == 6
    np.testing.assert_array_equal(t.depth, [0, 1, 1, 2, 0, 1])
    assert t.path(3) == [0, 1, 3] and t.path(5) == [4, 5]
    assert t.children(0) == [1, 2] and t.children(-1) == [0, 4]
    assert t.leaves() == [2, 3, 5]
    path, plen = t.path_array(3, 5)
    np.testing.assert_array_equal(path, [0, 1, 3, -1, -1])
    assert plen == 3
    assert t.parents.dtype == np.int32


def test_from_paths_builds_a_trie():
    t = DraftTree.from_paths([[5, 6, 7], [5, 6, 8], [5, 9], [4]])
    # breadth-first: depth 0: 5, 4; depth 1: 6, 9; depth 2: 7, 8
    np.testing.assert_array_equal(t.tokens, [5, 4, 6, 9, 7, 8])
    np.testing.assert_array_equal(t.parents, [-1, -1, 0, 0, 2, 2])
    assert [int(t.tokens[i]) for i in t.path(5)] == [5, 6, 8]
    with pytest.raises(ValueError, match="paths"):
        DraftTree.from_paths([])
    with pytest.raises(ValueError, match="paths"):
        DraftTree.from_paths([[1], []])


def test_padding_and_bitmask():
    t = DraftTree.from_parents([-1, 0, 1]).pad(5)
    np.testing.assert_array_equal(t.parents, [-1, 0, 1, -2, -2])
    assert t.num_real == 3 and t.num_nodes == 5
    np.testing.assert_array_equal(t.depth, [0, 1, 2, -1, -1])
    np.testing.assert_array_equal(t.bitmask(), [0b1, 0b11, 0b111, 0b1000, 0b10000])
    with pytest.raises(ValueError, match="n: cannot pad"):
        t.pad(2)
    with pytest.raises(ValueError, match="N <= 64"):
        DraftTree.from_parents(list(range(-1, 64))).bitmask()
    with pytest.raises(ValueError, match="not a real node"):
        t.path(3)


@pytest.mark.parametrize(
    ("parents", "match"),
    [
        ([-1, 1], r"parents\[1\] = 1 must be < its own index"),
        ([-1, 0, 5], r"parents\[2\] = 5 is out of range"),
        ([-1, -7], r"parents\[1\] = -7 is out of range"),
        ([-1, -2, 1], r"parents\[2\] = 1 is a padding node"),
        ([], "at least one node"),
        ([[-1, 0]], "1-D"),
        ([-1.0, 0.0], "must be integer"),
    ],
)
def test_validation_errors(parents, match):
    with pytest.raises(ValueError, match=match):
        DraftTree.from_parents(parents) if np.ndim(parents) == 1 else DraftTree(np.array(parents))


def test_tokens_must_match_parents():
    with pytest.raises(ValueError, match="tokens"):
        DraftTree.from_parents([-1, 0], tokens=[1, 2, 3])


@settings(max_examples=40, deadline=None)
@given(tree=trees())
def test_masks_agree_with_paths_and_device_closure(tree):
    t = DraftTree.from_parents(tree.tolist())
    mask = t.ancestor_mask()
    for n, path in enumerate(tree_paths(tree)):
        want = np.zeros(len(tree), bool)
        want[path] = True
        if tree[n] == -2:
            want[n] = True
        np.testing.assert_array_equal(mask[n], want)
        if tree[n] != -2:
            assert t.depth[n] == len(path) - 1
    np.testing.assert_array_equal(
        t.ancestor_mask(inclusive=False), mask & ~np.eye(len(tree), dtype=bool)
    )
    dev = np.asarray(ancestor_closure(jnp.asarray(tree)[None]))[0]
    np.testing.assert_array_equal(dev, mask)
    if len(tree) <= 64:
        bits = t.bitmask().view(np.uint64)
        for n in range(len(tree)):
            assert [i for i in range(len(tree)) if (int(bits[n]) >> i) & 1] == list(
                np.nonzero(mask[n])[0]
            )
