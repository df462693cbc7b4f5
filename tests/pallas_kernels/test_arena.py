"""The arena variants of the tree kernels (pallas_kernels.verify.arena, pallas_kernels.commit.arena; interpret mode): states read and
written through a handle table inside a uint32 arena give the same results as the dense kernels,
bit for bit, and no other arena word changes."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pallas_kernels as pk
from pallas_kernels.commit import arena as commit_arena
from pallas_kernels.verify import arena as verify_arena

HK, HV, K, V = 1, 2, 16, 32
SEGMENTS, WORDS, OFFSET = 5, 4096, 100


def _setup(seed, dtype, b=3, n=12):
    rng = np.random.default_rng(seed)
    cast = lambda x, dt=dtype: jnp.asarray(x, dt)
    q, k = (cast(rng.standard_normal((b, n, HK, K))) for _ in range(2))
    v = cast(rng.standard_normal((b, n, HV, V)))
    g = cast(-rng.uniform(0.01, 0.3, (b, n, HV)), jnp.float32)
    beta = cast(rng.uniform(0.2, 1.0, (b, n, HV)), jnp.float32)
    parents = np.stack([np.r_[-1, rng.integers(0, np.arange(1, n))] for _ in range(b)])
    s0 = rng.standard_normal((b, HV, K, V)).astype(np.float32)
    arena = rng.integers(0, 2**32, (SEGMENTS, WORDS), dtype=np.uint32)  # garbage everywhere
    # four handles at scattered, unaligned places; row 1 is padding (handle -1)
    table = np.array([[4, 5], [1, 2000], [2, 17], [0, 301]], np.int32)
    handles = np.array([2, -1, 0], np.int32)[:b]
    for row, h in enumerate(handles):
        if h >= 0:
            seg, word = table[h]
            arena[seg, word + OFFSET : word + OFFSET + HV * K * V] = s0[row].reshape(-1).view(
                np.uint32)
    dense = s0.copy()
    dense[handles < 0] = 0.0  # a padding row reads a zero state
    return (q, k, v, g, beta, jnp.asarray(parents, jnp.int32)), arena, table, handles, dense


def _state_span(table, h):
    seg, word = table[h]
    return seg, slice(word + OFFSET, word + OFFSET + HV * K * V)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_arena_verify_and_commit_match_dense(dtype):
    tree, arena, table, handles, dense = _setup(0, dtype)
    q, k, v, g, beta, parents = tree
    kw = dict(use_qk_l2norm=True, interpret=True)
    o, u, gp = verify_arena.tree_verify(
        *tree, jnp.asarray(arena), jnp.asarray(table), jnp.asarray(handles), state_offset=OFFSET,
        **kw)  # fmt: skip
    od, ud, gd = pk.tree_verify(*tree, jnp.asarray(dense), **kw)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(od))
    np.testing.assert_array_equal(np.asarray(u), np.asarray(ud))
    np.testing.assert_array_equal(np.asarray(gp), np.asarray(gd))

    path = jnp.asarray([[0, 1], [0, 0], [0, 2]], jnp.int32)
    path_len = jnp.asarray([2, 1, 1], jnp.int32)
    new = np.asarray(commit_arena.tree_commit(
        jnp.asarray(arena), jnp.asarray(table), jnp.asarray(handles), k, u, gp, path, path_len,
        state_offset=OFFSET, **kw))  # fmt: skip
    want = np.asarray(pk.tree_commit(jnp.asarray(dense), k, ud, gd, path, path_len, **kw))
    untouched = np.ones(arena.shape, bool)
    for row, h in enumerate(handles):
        if h < 0:
            continue
        seg, span = _state_span(table, h)
        got = new[seg, span].view(np.float32).reshape(HV, K, V)
        np.testing.assert_array_equal(got, want[row])
        untouched[seg, span] = False
    np.testing.assert_array_equal(new[untouched], arena[untouched])


def test_arena_bad_inputs_raise():
    tree, arena, table, handles, _ = _setup(1, np.float32)
    a, t, h = jnp.asarray(arena), jnp.asarray(table), jnp.asarray(handles)
    with pytest.raises(ValueError, match="arena:"):
        verify_arena.tree_verify(*tree, a.astype(jnp.int32), t, h, state_offset=OFFSET, interpret=True)
    with pytest.raises(ValueError, match="table:"):
        verify_arena.tree_verify(*tree, a, t[:, :1], h, state_offset=OFFSET, interpret=True)
    with pytest.raises(ValueError, match="handles:"):
        verify_arena.tree_verify(*tree, a, t, h[:2], state_offset=OFFSET, interpret=True)
    with pytest.raises(ValueError, match="state_offset:"):
        verify_arena.tree_verify(*tree, a, t, h, state_offset=WORDS - 10, interpret=True)
    with pytest.raises(ValueError, match="blocks:"):
        verify_arena.tree_verify(*tree, a, t, h, state_offset=OFFSET, interpret=True,
                       blocks=pk.VerifyBlocks(mode="x3"))  # fmt: skip


@settings(max_examples=4, deadline=None)
@given(
    b=st.integers(1, 3),
    n=st.sampled_from([5, 16]),
    offset=st.integers(0, 64),
    seed=st.integers(0, 2**31 - 1),
)
def test_arena_verify_commit_random_placements(b, n, offset, seed):
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
    parents = jnp.asarray(
        np.stack([np.r_[-1, rng.integers(0, np.arange(1, n))] for _ in range(b)]), jnp.int32)
    dense = rng.standard_normal((b, HV, K, V)).astype(np.float32)
    for row, h in enumerate(handles):
        if h < 0:
            dense[row] = 0.0
        else:
            seg, word = table[h]
            arena[seg, word + offset : word + offset + units] = dense[row].reshape(-1).view(
                np.uint32)
    tree = (q, k, v, g, beta, parents)
    addr = (jnp.asarray(arena), jnp.asarray(table, jnp.int32), jnp.asarray(handles))
    kw = dict(use_qk_l2norm=True, interpret=True)
    o, u, gp = verify_arena.tree_verify(*tree, *addr, state_offset=offset, **kw)
    od, ud, gd = pk.tree_verify(*tree, jnp.asarray(dense), **kw)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(od))
    np.testing.assert_array_equal(np.asarray(u), np.asarray(ud))
    # node 1's parent is always node 0, so [0, 1] is a root path; commit 0, 1 or 2 of it
    path = jnp.asarray(np.tile([0, 1], (b, 1)), jnp.int32)
    path_len = jnp.asarray(rng.integers(0, 3, b), jnp.int32)
    new = np.asarray(commit_arena.tree_commit(*addr, k, u, gp, path, path_len, state_offset=offset, **kw))
    want = np.asarray(pk.tree_commit(jnp.asarray(dense), k, ud, gd, path, path_len, **kw))
    untouched = np.ones(arena.shape, bool)
    for row, h in enumerate(handles):
        if h >= 0:
            seg, word = table[h]
            span = slice(word + offset, word + offset + units)
            np.testing.assert_array_equal(
                new[seg, span].view(np.float32).reshape(HV, K, V), want[row])
            untouched[seg, span] = False
    np.testing.assert_array_equal(new[untouched], arena[untouched])
