"""Hypothesis strategies: random draft trees and random GDN inputs (never zeros)."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

TREE_KINDS = ("chain", "star", "random", "forest", "padded")


def make_tree(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """int32 ``[n]`` parents of a tree of the given kind (topological order)."""
    if kind == "chain":
        return np.arange(-1, n - 1, dtype=np.int32)
    if kind == "star":
        return np.array([-1] + [0] * (n - 1), np.int32)
    parents = np.empty(n, np.int32)
    real = n if kind != "padded" else max(1, int(rng.integers(1, n + 1)))
    for i in range(real):
        if i == 0:
            parents[i] = -1
        elif kind == "forest" and rng.random() < 0.25:
            parents[i] = -1
        else:
            # bias towards recent nodes so trees get deep as well as wide
            parents[i] = int(i - 1 - min(int(rng.geometric(0.5)) - 1, i - 1))
    parents[real:] = -2
    return parents


@st.composite
def trees(draw, n: int | None = None, kinds=TREE_KINDS) -> np.ndarray:
    n = draw(st.sampled_from([1, 2, 5, 8, 16, 33])) if n is None else n
    kind = draw(st.sampled_from(kinds))
    seed = draw(st.integers(0, 2**31 - 1))
    return make_tree(kind, n, np.random.default_rng(seed))


def make_inputs(rng, b, t, hk, hv, dk, dv, *, decay="mild", dtype=np.float32):
    """Random ``q, k, v, g, beta, S0`` with keys of norm ~1 (as after l2norm)."""
    q = rng.normal(size=(b, t, hk, dk))
    k = rng.normal(size=(b, t, hk, dk)) / np.sqrt(dk)
    v = rng.normal(size=(b, t, hv, dv))
    if decay == "mild":
        g = -rng.uniform(0.0, 1.0, size=(b, t, hv))
    elif decay == "strong":
        g = -rng.uniform(0.0, 30.0, size=(b, t, hv))
        g[rng.random(g.shape) < 0.3] = -30.0
    else:  # "mixed": mostly mild with occasional near-resets
        g = -rng.exponential(0.5, size=(b, t, hv))
        g[rng.random(g.shape) < 0.1] = -30.0
    beta = rng.uniform(0.05, 1.0, size=(b, t, hv))
    s0 = rng.normal(size=(b, hv, dk, dv))
    cast = lambda x: x.astype(dtype)
    return (
        cast(q),
        cast(k),
        cast(v),
        g.astype(np.float32),
        beta.astype(np.float32),
        s0.astype(np.float32),
    )


# A fixed menu keeps compiled programs few (CPU CI) while covering Hk | Hv with groups of 1..3
# and K != V both ways.
HEAD_SHAPES = [(1, 1, 4, 4), (1, 3, 8, 4), (2, 4, 4, 6), (2, 2, 8, 8)]


def head_shapes():
    """``(Hk, Hv, K, V)`` with ``Hk | Hv`` and ``K != V`` allowed."""
    return st.sampled_from(HEAD_SHAPES)
