"""The TPU tree verify (``pallas_kernels.tpu.verify``) in TPU interpret mode: against float64
and the XLA path over random trees (chains, stars, forests, padded trees), grouped heads, bf16
inputs, 128 nodes, both solves; the arena variant against the dense kernel; the input checks;
and the Mosaic lowering at Qwen3.5 dims on v5e and v6e."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import tpu
from tests.gdn_jax.strategies import make_tree
from tests.pallas_kernels.common import tree_inputs
from tests.pallas_kernels.tpu.common import (
    HK,
    HV,
    OFFSET,
    TREE,
    K,
    V,
    arena_operands,
    arena_shapes,
    arena_with,
    lowers,
    shapes,
    verify,
)


@pytest.mark.parametrize(
    "hk, hv, dk, dv, dtype",
    [(1, 2, 16, 32, np.float32), (2, 4, 32, 16, jnp.bfloat16)],
    ids=["f32-grouped", "bf16-grouped"],
)
def test_fixed_tree(hk, hv, dk, dv, dtype):
    """A forest with a padding node and a chain; grouped heads, K != V; two rows and two heads
    stacked in one program."""
    verify(TREE, hk, hv, dk, dv, dtype)


@settings(max_examples=3, deadline=None)
@given(
    kinds=st.lists(
        st.sampled_from(["chain", "star", "random", "forest", "padded"]), min_size=2, max_size=2
    ),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_trees(kinds, seed):
    """Random trees of every kind (12 nodes, two rows), strong and mixed decays."""
    rng = np.random.default_rng(seed)
    parents = np.stack([make_tree(kind, 12, rng) for kind in kinds])
    verify(
        parents, 1, 2, 16, 16, np.float32, seed=seed % 1000, decay="strong" if seed % 2 else "mixed"
    )


def test_wide_mxu():
    """On a 256-wide MXU (v6e): the rows' state products as one block-diagonal dot, the f32
    dots against ``V = 128`` columns in two passes; the same values as the 128-wide schedule."""
    wide = tpu.TpuVerifyBlocks(mxu_rows=256)
    inputs, got, _ = verify(TREE, 1, 2, 16, 128, np.float32, blocks=wide)
    par = jnp.asarray(TREE)
    want = tpu.tree_verify(*inputs[:5], par, inputs[5], use_qk_l2norm=True, interpret=True)
    for x, y in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "mxu_rows, b, grp, npad, heads, want",
    [
        (256, 16, 4, 64, 0, (2, 2)),  # 397B on v6e: the state product fits one tile
        (256, 16, 2, 64, 0, (2, 2)),  # 35B on v6e
        (128, 16, 2, 64, 0, (1, 2)),  # 35B on v5e: no stacking fits a tile; most heads
        (128, 1, 2, 64, 0, (1, 2)),
        (128, 16, 4, 128, 0, (1, 1)),  # N 128: one system a program
        (128, 16, 2, 64, 1, (2, 1)),  # heads given, rows fill the MXU
        (128, 16, 3, 16, 0, (8, 1)),  # more systems beat more heads
    ],
)
def test_stacking(mxu_rows, b, grp, npad, heads, want):
    blocks = tpu.TpuVerifyBlocks(mxu_rows=mxu_rows, heads=heads)
    assert blocks.stacking(b, grp, npad, 128, 128) == want


def test_128_node_chain_blocked():
    """A 128-node chain (the deepest tree: every inverse step) with blocked forward
    substitution, and a 128-node random tree with the default Newton-Schulz solve."""
    chain = (np.arange(128, dtype=np.int32) - 1)[None]
    verify(chain, 1, 1, 16, 16, np.float32, blocks=tpu.TpuVerifyBlocks(inverse="blocked"))
    tree = make_tree("random", 128, np.random.default_rng(3))[None]
    verify(tree, 1, 1, 16, 16, np.float32, seed=3)


def test_arena_matches_dense():
    """States read through the handle table (row 1 padding: zeros) give the dense kernel's
    outputs bit for bit."""
    rng = np.random.default_rng(1)
    parents = np.stack([make_tree("random", 10, rng) for _ in range(3)])
    q, k, v, g, beta, _ = tree_inputs(parents, HK, HV, K, V, np.float32, seed=1)
    arena, dense = arena_with(rng.standard_normal((3, HV, K, V)), rng)
    par = jnp.asarray(parents)
    got = tpu.tree_verify_arena(
        q, k, v, g, beta, par, *arena_operands(arena),
        state_offset=OFFSET, use_qk_l2norm=True, interpret=True,
    )  # fmt: skip
    want = tpu.tree_verify(
        q, k, v, g, beta, par, jnp.asarray(dense), use_qk_l2norm=True, interpret=True
    )
    for x, y in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def zero_tree(n: int, hk: int, hv: int, dk: int, dv: int = 16):
    """Zero ``q, k, v, g, beta`` of one row of ``n`` nodes and a chain's ``parents``."""
    par = jnp.arange(n, dtype=jnp.int32)[None] - 1
    return (
        jnp.zeros((1, n, hk, dk)),
        jnp.zeros((1, n, hk, dk)),
        jnp.zeros((1, n, hv, dv)),
        jnp.zeros((1, n, hv)),
        jnp.zeros((1, n, hv)),
        par,
    )


@pytest.mark.parametrize(
    "n, hk, hv, dk, blocks, match",
    [
        (129, 1, 2, 16, None, "at most 128 nodes"),
        (8, 1, 2, 12, None, "K: .*multiple of 8"),
        (8, 2, 3, 16, None, "multiple of key heads"),
        (8, 1, 2, 16, tpu.TpuVerifyBlocks(heads=3), "blocks.heads"),
    ],
    ids=["nodes", "head-dim", "grouped-heads", "stacked-heads"],
)
def test_bad_inputs_raise(n, hk, hv, dk, blocks, match):
    s0 = jnp.zeros((1, hv, dk, 16))
    blocks = blocks or tpu.TpuVerifyBlocks()
    with pytest.raises(ValueError, match=match):
        tpu.tree_verify(*zero_tree(n, hk, hv, dk), s0, blocks=blocks)


def test_bad_arena_and_blocks_raise():
    with pytest.raises(ValueError, match="V: the TPU arena kernels need V == 128"):
        tpu.tree_verify_arena(
            *zero_tree(8, 1, 2, 16),
            jnp.zeros((2, 4096), jnp.uint32),
            jnp.zeros((2, 2), jnp.int32),
            jnp.zeros((1,), jnp.int32),
            state_offset=0,
        )
    for bad in (dict(inverse="lu"), dict(block=12), dict(refine_steps=5), dict(precision="bf16")):
        with pytest.raises(ValueError, match="blocks."):
            tpu.TpuVerifyBlocks(**bad)


@pytest.mark.parametrize("device_kind, mxu_rows", [("TPU v5 lite", 128), ("TPU v6 lite", 256)])
def test_lowers_at_qwen_dims(device_kind, mxu_rows):
    """The dense and arena kernels lower to Mosaic at Qwen3.5-35B dims (bf16, N 64, grouped
    heads stacked to the chip's MXU rows): block shapes, memory spaces and every op pass the
    Pallas TPU lowering."""
    b, n, hk, hv, d = 4, 64, 2, 4, 128
    bf, f = jnp.bfloat16, jnp.float32
    blocks = tpu.TpuVerifyBlocks(mxu_rows=mxu_rows)
    dense = shapes(
        ((b, n, hk, d), bf),
        ((b, n, hk, d), bf),
        ((b, n, hv, d), bf),
        ((b, n, hv), f),
        ((b, n, hv), f),
        ((b, n), jnp.int32),
        ((b, hv, d, d), f),
    )
    assert lowers(
        lambda *a: tpu.tree_verify(*a, use_qk_l2norm=True, blocks=blocks),
        *dense,
        device_kind=device_kind,
    )
    fn = lambda *a: tpu.tree_verify_arena(*a, state_offset=128, use_qk_l2norm=True, blocks=blocks)
    assert lowers(fn, *dense[:6], *arena_shapes(b), device_kind=device_kind)


@pytest.mark.parametrize("n", [24, 64])
def test_deep_chains_of_alike_keys(n):
    """Deeper than 16 nodes, keys nearly equal, slow decay, large beta: the doubling's powers
    grow like binomial coefficients and one-pass bf16 loses X (U off by 1e8 at N 64); the block
    inverse keeps U near the exact one with the default refinement step, within 4e-5 with
    two. Interpret mode runs the dots as the MXU does."""
    from pallas_kernels.verify.reference import tree_verify_reference
    from tests.gdn_jax.reference import rel_err

    parents = (np.arange(n, dtype=np.int32) - 1)[None]
    rng = np.random.default_rng(1)
    q, k, v, g, beta, s0 = tree_inputs(parents, 1, 1, 128, 128, jnp.bfloat16, 0, "mild")
    k = jnp.asarray(rng.normal(size=128) + 0.03 * rng.normal(size=k.shape), jnp.bfloat16)
    args = (q, k, v, 0.01 * g, jnp.minimum(2 * beta, 1.0), jnp.asarray(parents), s0)
    _, u_ref, _ = tree_verify_reference(*args, use_qk_l2norm=True)
    for steps, tol in ((1, 5e-4), (2, 4e-5)):
        blocks = tpu.TpuVerifyBlocks(refine_steps=steps)
        u = tpu.tree_verify(*args, use_qk_l2norm=True, blocks=blocks, interpret=True)[1]
        assert rel_err(u, u_ref) < tol, (steps, rel_err(u, u_ref))
