"""The Mosaic GPU tree verify (``pallas_kernels/verify/mgpu.py``) in Mosaic GPU's interpret mode:
``o`` against float64 (per-node recurrence) and ``u``, ``g_path`` against the XLA path, over
random trees, chains, forests and padding; its refinement; its checks."""

from __future__ import annotations

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gdn_jax import tree_verify
from pallas_kernels.verify import ancestor_mask
from pallas_kernels.verify.mgpu import MgpuVerifyBlocks, tree_verify_mgpu
from pallas_kernels.verify.reference import tree_verify_reference
from tests.gdn_jax.reference import rel_err, tree64
from tests.pallas_kernels.common import FIXED_TREE, tree_inputs

BF16 = jnp.bfloat16


def random_tree(rng, n: int) -> np.ndarray:
    """Parents among the previous four nodes, some roots (-1)."""
    par = np.array([rng.integers(max(-1, i - 4), i) for i in range(n)])
    par[rng.random(n) < 0.08] = -1
    return par.astype(np.int32)


def check(parents, hk, hv, dk, dv, decay="mild", seed=0, blocks=None, ancestors=False):
    """The kernel against float64 (``o``) and the XLA path (``u``, ``g_path``); returns
    ``u``'s relative error against XLA."""
    q, k, v, g, beta, s0 = tree_inputs(parents, hk, hv, dk, dv, BF16, seed, decay)
    kw = dict(use_qk_l2norm=True, interpret=True, blocks=blocks or MgpuVerifyBlocks())
    if ancestors:
        kw["ancestors"] = ancestor_mask(jnp.asarray(parents))
    o, u, g_path = tree_verify_mgpu(q, k, v, g, beta, jnp.asarray(parents), s0, **kw)
    b, n = parents.shape
    chex.assert_shape((o, u), (b, n, hv, dv))
    chex.assert_type((o, u, g_path), (BF16, jnp.float32, jnp.float32))
    chex.assert_tree_all_finite((o, u, g_path))
    ox, cx = tree_verify(q, k, v, g, beta, parents, s0, use_qk_l2norm=True, impl="xla")
    o64, _ = tree64(q, k, v, g, beta, parents, s0, use_qk_l2norm=True)
    real = parents >= -1
    assert rel_err(np.asarray(o)[real], o64[real]) < 1e-2  # the bf16 rounding of o
    assert rel_err(np.asarray(o)[real], np.asarray(ox)[real]) < 1e-2
    assert rel_err(g_path, cx.g_path) < 1e-6
    err = rel_err(np.asarray(u)[real], np.asarray(cx.u)[real])
    assert err < 2e-5, err
    return err


@pytest.mark.parametrize(
    "name, hk, hv, dk, dv, decay",
    [
        ("fixed", 1, 2, 64, 64, "mixed"),  # a forest with a padding node, and a chain
        ("random64", 2, 4, 128, 128, "mild"),  # grouped heads, N = 64
        ("chain64", 1, 1, 128, 64, "strong"),  # every doubling; decays down to g = -30
    ],
)
def test_matches_float64_and_xla(name, hk, hv, dk, dv, decay):
    rng = np.random.default_rng(3)
    parents = {
        "fixed": FIXED_TREE,
        "random64": np.stack([random_tree(rng, 64), random_tree(rng, 64)]),
        "chain64": np.arange(64, dtype=np.int32)[None] - 1,
    }[name]
    check(parents, hk, hv, dk, dv, decay)


@settings(max_examples=3, deadline=None)
@given(
    n=st.integers(16, 64),
    grp=st.sampled_from([1, 2]),
    dims=st.sampled_from([(64, 64), (128, 64), (64, 128)]),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_trees_and_shapes(n, grp, dims, seed):
    parents = random_tree(np.random.default_rng(seed), n)[None]
    check(parents, 1, grp, *dims, decay="mixed", seed=seed)


def test_given_ancestors_and_refinement():
    """A precomputed ancestor mask gives the same result; without refinement steps ``u`` is
    off by the bf16 inverse's error (so the refinement is what makes it exact)."""
    parents = np.arange(64, dtype=np.int32)[None] - 1  # a chain: the deepest tree
    check(parents, 1, 1, 64, 64, ancestors=True)
    q, k, v, g, beta, s0 = tree_inputs(parents, 1, 1, 64, 64, BF16, 0, "mild")
    kw = dict(use_qk_l2norm=True, interpret=True)
    args = (q, k, v, g * 0.05, beta, jnp.asarray(parents), s0)  # slow decay: long memory
    _, cx = tree_verify(*args, use_qk_l2norm=True, impl="xla")
    u0 = tree_verify_mgpu(*args, blocks=MgpuVerifyBlocks(refine_steps=0), **kw)[1]
    u2 = tree_verify_mgpu(*args, **kw)[1]
    assert rel_err(u2, cx.u) < 2e-5 < rel_err(u0, cx.u), (rel_err(u2, cx.u), rel_err(u0, cx.u))


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(dtype=jnp.float32), "^q: the Mosaic GPU tree verify takes bfloat16"),
        (dict(n=65), "^q: the Mosaic GPU tree verify takes at most 64 nodes, got 65"),
        (dict(dk=32), "^k, v: the Mosaic GPU tree verify takes K, V of 64 or 128"),
        (dict(state=(1, 2, 64, 32)), r"^initial_state: expected \[B, Hv, K, V\]"),
        (dict(interpret=False), "^impl: the Mosaic GPU tree verify needs a compute capability"),
    ],
)
def test_checks(change, match):
    n, dk, dtype = change.get("n", 16), change.get("dk", 64), change.get("dtype", BF16)
    q = k = jnp.ones((1, n, 1, dk), dtype)
    v = jnp.ones((1, n, 2, 64), dtype)
    g = beta = jnp.ones((1, n, 2), jnp.float32)
    parents = jnp.arange(n, dtype=jnp.int32)[None] - 1
    s0 = jnp.ones(change.get("state", (1, 2, dk, 64)), jnp.float32)
    with pytest.raises(ValueError, match=match):
        tree_verify_mgpu(q, k, v, g, beta, parents, s0, interpret=change.get("interpret", True))


def test_knob_checks():
    with pytest.raises(ValueError, match="^refine_steps"):
        MgpuVerifyBlocks(refine_steps=5)


@pytest.mark.parametrize("n", [24, 64])
def test_deep_chains_of_alike_keys(n):
    """Deeper than 16 nodes, keys nearly equal, slow decay, large beta (the case the block
    inverse is for: whole-tree bf16 doubling leaves U off by 3e6 at N 64). Interpret mode
    runs this kernel's bf16 operands as they are, so it shows what the GPU computes."""
    parents = (np.arange(n, dtype=np.int32) - 1)[None]
    rng = np.random.default_rng(1)
    q, k, v, g, beta, s0 = tree_inputs(parents, 1, 1, 64, 64, BF16, 0, "mild")
    k = jnp.asarray(rng.normal(size=64) + 0.03 * rng.normal(size=k.shape), BF16)
    args = (q, k, v, 0.01 * g, jnp.minimum(2 * beta, 1.0), jnp.asarray(parents), s0)
    _, u_ref, _ = tree_verify_reference(*args, use_qk_l2norm=True)
    u = tree_verify_mgpu(*args, use_qk_l2norm=True, interpret=True)[1]
    assert rel_err(u, u_ref) < 4e-5, rel_err(u, u_ref)
