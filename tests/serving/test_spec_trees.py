"""Host draft trees: sparse proposals (``TreeBuilder.propose``) build the same tree as the dense
``expand(..., proposals=True)``, and the n-gram drafter's sparse candidates equal a brute-force
count."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.drafters import NgramDrafter, ngram_candidates
from serving.params import SpecConfig
from serving.spec_trees import TreeBuilder

SPECS = [
    SpecConfig(method="ngram", tree=(3, 2, 1)),
    SpecConfig(method="ngram", budget=9, depth=4, branch=3),
]


def _grow(spec, vocab, seed, sparse):
    """A tree whose every node proposes random candidates (repeated probabilities included,
    so ties are broken by the token), densely or sparsely."""
    rng = np.random.default_rng(seed)
    tb = TreeBuilder(int(rng.integers(vocab)), spec, None)
    level = 0
    while nodes := tb.frontier(level):
        for node in nodes:
            c = int(rng.integers(1, 6))
            toks = rng.choice(vocab, c, replace=False)
            probs = rng.integers(1, 4, c).astype(np.float64)
            probs /= probs.sum()
            if sparse:
                tb.propose(node, toks, probs)
            else:
                q = np.zeros(vocab)
                q[toks] = probs
                tb.expand(node, q, proposals=True)
        level += 1
    tb.finish()
    return tb


@pytest.mark.parametrize("spec", SPECS, ids=["static", "budget"])
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_propose_equals_dense_expand(spec, seed):
    dense, sparse = _grow(spec, 50, seed, False), _grow(spec, 50, seed, True)
    assert sparse.tokens == dense.tokens
    assert sparse.parents == dense.parents
    np.testing.assert_allclose(sparse.logp, dense.logp, rtol=1e-12)


def test_propose_rejects_bad_candidates():
    tb = TreeBuilder(0, SPECS[0], None)
    with pytest.raises(ValueError, match="tokens, probs"):
        tb.propose(0, [1, 2], [1.0])
    with pytest.raises(ValueError, match="distinct"):
        tb.propose(0, [1, 1], [0.5, 0.5])
    with pytest.raises(ValueError, match="positive"):
        tb.propose(0, [1, 2], [1.0, 0.0])


@settings(max_examples=50, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), min_size=1, max_size=40),
    ngram_max=st.integers(1, 4),
)
def test_ngram_candidates_brute_force(tokens, ngram_max):
    t = np.asarray(tokens, np.int64)
    want = None
    for n in range(min(ngram_max, len(t) - 1), 0, -1):
        nxt = [t[i + n] for i in range(len(t) - n) if (t[i : i + n] == t[-n:]).all()]
        if nxt:
            want = np.unique(nxt, return_counts=True)
            break
    got = ngram_candidates(t, ngram_max)
    if want is None:
        assert got is None
    else:
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


def test_ngram_drafter_on_a_large_vocabulary():
    """Qwen3.5's 248K vocabulary: the drafter's tree holds the continuations seen before."""
    vocab = 248_320
    ctx = np.array([7, 200_000, 9, 7, 200_000, 11, 7], np.int64)
    tb = TreeBuilder(7, SPECS[0], None)
    NgramDrafter(3, vocab).draft([ctx], [tb])
    assert tb.tokens[1:2] == [200_000]
    assert sorted(tb.tokens[2:4]) == [9, 11]
