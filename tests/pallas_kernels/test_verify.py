"""The tree verify kernels (``pallas_kernels.verify``, interpret mode): the fused kernel
(``kernel.py``) against float64 numpy, the gdn_jax XLA path and ``verify/reference.py``; the
arena kernel (``arena.py``) against its reference and its input checks; the snapshot kernel
(``snapshot.py``); the node and shape limits; and ``verify/reference.py`` itself against the
float64 numpy reference.

Shapes are tiny (interpret mode runs the kernel body op by op on the CPU): K, V in {16, 32},
N <= 16 (one 128-node tree), a handful of hypothesis examples over random trees. The GPU limits
(shared memory per block) are checked without a device: they raise before lowering.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pallas_kernels as pk
from gdn_jax.dispatch import AUTO_PALLAS
from gdn_jax.pallas_routes import verify_blocks_for
from pallas_kernels.commit.kernel import commit_shared_memory
from pallas_kernels.verify import arena as verify_arena
from pallas_kernels.verify.kernel import check_gpu_limits, refine_shared_memory
from pallas_kernels.verify.reference import (
    snapshot_verify_reference,
    tree_verify_arena_reference,
    tree_verify_reference,
)
from tests.gdn_jax.reference import prep64, rel_err, tree64
from tests.gdn_jax.strategies import head_shapes, make_tree, trees
from tests.pallas_kernels.common import (
    FIXED_TREE,
    OFFSET,
    TOL,
    WORDS,
    arena_tree_setup,
    check_verify,
    tree_inputs,
)


@pytest.mark.parametrize(
    "hk, hv, dk, dv, dtype, l2",
    [(1, 2, 16, 16, np.float32, True), (2, 2, 16, 32, jnp.bfloat16, False)],
)
def test_fixed_tree(hk, hv, dk, dv, dtype, l2):
    """A forest with a padding node and a chain, grouped heads, K != V, bf16 inputs."""
    check_verify(FIXED_TREE, hk, hv, dk, dv, dtype, l2)


@settings(max_examples=3, deadline=None)
@given(
    kind=st.sampled_from(["random", "forest", "padded", "star"]),
    n=st.sampled_from([5, 16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_trees(kind, n, seed):
    parents = make_tree(kind, n, np.random.default_rng(seed))[None]
    check_verify(parents, 1, 2, 16, 16, np.float32, True, decay="mixed", seed=seed % 1000)


@pytest.mark.parametrize(
    "blocks",
    [
        pk.VerifyBlocks(mode="x3"),
        pk.VerifyBlocks(ancestors_input=True, block_v=16),
        pk.VerifyBlocks(depth_loop=False, refine_steps=0, output_precision="tf32"),
        pk.VerifyBlocks(refine_steps=2, inverse_precision="bf16", precision="bf16x3"),
    ],
    ids=["x3", "ancestors-input", "static-doubling", "bf16-inverse"],
)
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_variants(blocks, dtype):
    """Every VerifyBlocks variant gives the same O and U (chain + forest with padding)."""
    check_verify(FIXED_TREE, 1, 2, 16, 32, dtype, True, blocks=blocks)


def test_precomputed_ancestors():
    """A precomputed ancestor mask (padded here from N 10 to 16) gives the same bits as the
    kernel's own; misuse raises ValueError."""
    q, k, v, g, beta, s0 = tree_inputs(FIXED_TREE, 1, 2, 16, 16, np.float32, seed=3)
    par = jnp.asarray(FIXED_TREE)
    bl = pk.VerifyBlocks(ancestors_input=True)

    def run(**kw):
        return pk.tree_verify(q, k, v, g, beta, par, s0, use_qk_l2norm=True, interpret=True, **kw)

    mask = pk.ancestor_mask(par)
    for got, want in zip(run(blocks=bl, ancestors=mask), run(blocks=bl), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="ancestors"):
        run(blocks=bl, ancestors=mask[:, :5])
    with pytest.raises(ValueError, match="ancestors"):
        run(ancestors=mask)


def test_depth_loop_deep_chain():
    """A 40-node chain needs all six doublings of the depth-adaptive inverse."""
    parents = (np.arange(40, dtype=np.int32) - 1)[None]
    check_verify(parents, 1, 1, 16, 16, np.float32, True, decay="mixed", seed=11)


@pytest.fixture
def gpu_one_pass(monkeypatch):
    """The verify kernel's one-pass dots (its approximate inverse) as the GPU runs them: operands
    rounded to bf16, f32 accumulation (interpret mode otherwise runs them as plain f32 dots,
    which hides how far a bf16 inverse can drift)."""
    from pallas_kernels.verify import kernel as vk

    real_dot = vk.dot

    def dot(a, b, precision, **kw):
        if precision == "gpu-one-pass":
            return real_dot(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), None, **kw)
        return real_dot(a, b, precision, **kw)

    monkeypatch.setattr(vk, "dot", dot)
    monkeypatch.setattr(vk, "_one_pass", lambda name, interpret: "gpu-one-pass")


@pytest.mark.parametrize("n", [24, 64])
def test_deep_chains_of_alike_keys_with_the_gpu_one_pass_inverse(gpu_one_pass, n):
    """Chains deeper than DOUBLING_MAX_DEPTH whose keys are nearly equal, with slow decay and
    large beta: the Neumann terms of (I + A)^-1 grow like binomial coefficients, so a bf16
    product doubling over the whole chain loses T0 (U off by 3e6 at N 64, 3e-4 at 24);
    the block inverse keeps U within the exact verify's error."""
    from pallas_kernels.verify import kernel as vk

    parents = (np.arange(n, dtype=np.int32) - 1)[None]
    rng = np.random.default_rng(1)
    q, k, v, g, beta, s0 = tree_inputs(parents, 1, 1, 64, 64, jnp.bfloat16, 0, "mild")
    base = rng.normal(size=64)
    k = jnp.asarray(base + 0.03 * rng.normal(size=k.shape), jnp.bfloat16)  # cosine ~ 0.9996
    args = (q, k, v, 0.01 * g, jnp.minimum(2 * beta, 1.0), jnp.asarray(parents), s0)
    _, u_ref, _ = tree_verify_reference(*args, use_qk_l2norm=True)
    blocks = pk.VerifyBlocks(precision="bf16x3")
    _, u, _ = pk.tree_verify(*args, use_qk_l2norm=True, blocks=blocks, interpret=True)
    assert n > vk.DOUBLING_MAX_DEPTH and rel_err(u, u_ref) < 2e-5, rel_err(u, u_ref)


@pytest.mark.parametrize(
    "bad",
    [
        dict(mode="fast"),
        dict(precision="f64"),
        dict(inverse_precision="x3"),
        dict(output_precision="bf16"),
        dict(refine_steps=9),
    ],
)
def test_blocks_reject_bad_knobs(bad):
    with pytest.raises(ValueError, match="blocks."):
        pk.VerifyBlocks(**bad)


@settings(max_examples=3, deadline=None)
@given(
    parents=trees(n=16, kinds=("random", "forest", "padded")),
    heads=st.sampled_from([(1, 2, 16, 16), (2, 2, 16, 32)]),
    dtype=st.sampled_from([np.float32, jnp.bfloat16]),
    l2=st.booleans(),
    seed=st.integers(0, 999),
)
def test_matches_reference(parents, heads, dtype, l2, seed):
    """The fused kernel equals ``verify/reference.py`` (o, u, g_path) on the real nodes."""
    parents = parents[None]
    inputs = tree_inputs(parents, *heads, dtype, seed=seed, decay="mixed")
    par = jnp.asarray(parents)
    got = pk.tree_verify(*inputs[:5], par, inputs[5], use_qk_l2norm=l2, interpret=True)
    want = tree_verify_reference(*inputs[:5], par, inputs[5], use_qk_l2norm=l2)
    chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
    real = parents >= -1
    o, u, g_path = (np.asarray(x, np.float32)[real] for x in got)
    o_r, u_r, g_r = (np.asarray(x, np.float32)[real] for x in want)
    assert rel_err(o, o_r) < TOL[dtype]
    assert rel_err(u, u_r) < 2e-5
    assert rel_err(g_path, g_r) < 1e-6


def _u_and_g_path64(q, k, v, g, beta, parents, s0, states64, l2):
    """float64 ``u [B, N, Hv, V]`` and ``g_path [B, N, Hv]`` of every real node from its
    parent's float64 state (``S0`` above a root)."""
    _, k = prep64(q, k, None, l2)
    v, g, beta, s0 = (np.asarray(x, np.float64) for x in (v, g, beta, s0))
    b, n, hv, dv = v.shape
    grp = hv // k.shape[2]
    u, g_path = np.zeros((b, n, hv, dv)), np.zeros((b, n, hv))
    for r in range(b):
        for i, p in enumerate(parents[r]):
            if p == -2:
                continue
            s_par = s0[r] if p == -1 else states64[r, p]
            g_path[r, i] = g[r, i] + (g_path[r, p] if p >= 0 else 0.0)
            for h in range(hv):
                s = np.exp(g[r, i, h]) * s_par[h]
                u[r, i, h] = beta[r, i, h] * (v[r, i, h] - s.T @ k[r, i, h // grp])
    return u, g_path


@settings(max_examples=8, deadline=None)
@given(
    parents=trees(),
    heads=head_shapes(),
    decay=st.sampled_from(["mild", "strong", "mixed"]),
    l2=st.booleans(),
    seed=st.integers(0, 999),
)
def test_reference_matches_float64(parents, heads, decay, l2, seed):
    """``verify/reference.py`` (o, u, g_path and the per-node states) equals the float64
    recurrence along every node's path."""
    parents = np.stack([parents, make_tree("chain", len(parents), np.random.default_rng())])
    inputs = tree_inputs(parents, *heads, np.float32, seed=seed, decay=decay)
    par = jnp.asarray(parents)
    o, u, g_path = tree_verify_reference(*inputs[:5], par, inputs[5], use_qk_l2norm=l2)
    o_s, states = snapshot_verify_reference(*inputs[:5], par, inputs[5], use_qk_l2norm=l2)
    o64, states64 = tree64(*inputs[:5], parents, inputs[5], use_qk_l2norm=l2)
    u64, g64 = _u_and_g_path64(*inputs[:5], parents, inputs[5], states64, l2)
    real = parents >= -1
    chex.assert_tree_all_finite((o, u, g_path, states))  # padding nodes too
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_s))
    assert rel_err(np.asarray(o)[real], o64[real]) < 1e-5
    assert rel_err(np.asarray(u)[real], u64[real]) < 1e-5
    assert rel_err(np.asarray(g_path)[real], g64[real]) < 1e-6
    assert rel_err(np.asarray(states)[real], states64[real]) < 1e-5


def test_snapshot():
    """The snapshot kernel's outputs and per-node states against float64 and
    ``verify/reference.py``."""
    q, k, v, g, beta, s0 = tree_inputs(FIXED_TREE, 1, 2, 16, 16, np.float32, seed=4)
    par = jnp.asarray(FIXED_TREE)
    o, snaps = pk.snapshot_verify(q, k, v, g, beta, par, s0, use_qk_l2norm=True, interpret=True)
    o64, states64 = tree64(q, k, v, g, beta, FIXED_TREE, s0, use_qk_l2norm=True)
    real = FIXED_TREE >= -1
    assert rel_err(np.asarray(o)[real], o64[real]) < 2e-5
    assert rel_err(np.asarray(snaps)[real], states64[real]) < 2e-5
    o_r, states_r = snapshot_verify_reference(q, k, v, g, beta, par, s0, use_qk_l2norm=True)
    assert rel_err(np.asarray(o)[real], np.asarray(o_r)[real]) < 2e-5
    assert rel_err(np.asarray(snaps)[real], np.asarray(states_r)[real]) < 2e-5


def test_arena_matches_reference():
    """The arena kernel (states read through the handle table, row 1 padding) equals
    ``tree_verify_arena_reference`` on the real nodes."""
    tree, arena, table, handles, _ = arena_tree_setup(2, np.float32)
    addr = (jnp.asarray(arena), jnp.asarray(table), jnp.asarray(handles))
    kw = dict(state_offset=OFFSET, use_qk_l2norm=True)
    got = verify_arena.tree_verify(*tree, *addr, interpret=True, **kw)
    want = tree_verify_arena_reference(*tree, *addr, **kw)
    real = np.asarray(tree[-1]) >= -1
    for x, y, tol in zip(got, want, (2e-5, 2e-5, 1e-6), strict=True):
        assert rel_err(np.asarray(x)[real], np.asarray(y)[real]) < tol


def test_arena_bad_inputs_raise():
    tree, arena, table, handles, _ = arena_tree_setup(1, np.float32)
    a, t, h = jnp.asarray(arena), jnp.asarray(table), jnp.asarray(handles)

    def run(*addr, offset=OFFSET, **kw):
        return verify_arena.tree_verify(*tree, *addr, state_offset=offset, interpret=True, **kw)

    with pytest.raises(ValueError, match="arena:"):
        run(a.astype(jnp.int32), t, h)
    with pytest.raises(ValueError, match="table:"):
        run(a, t[:, :1], h)
    with pytest.raises(ValueError, match="handles:"):
        run(a, t, h[:2])
    with pytest.raises(ValueError, match="state_offset:"):
        run(a, t, h, offset=WORDS - 10)
    with pytest.raises(ValueError, match="blocks:"):
        run(a, t, h, blocks=pk.VerifyBlocks(mode="x3"))


def _zeros(n, k=16, v=16):
    """Zero ``q, v [1, n, 1, *]``, ``g [1, n, 1]`` and a chain's parents (the limit checks
    raise before any value is read)."""
    q, vv = jnp.zeros((1, n, 1, k)), jnp.zeros((1, n, 1, v))
    return q, vv, jnp.zeros((1, n, 1)), jnp.arange(n, dtype=jnp.int32)[None] - 1


def test_limits_raise():
    s0 = jnp.zeros((1, 1, 16, 16))
    q, v, g, par = _zeros(129)
    with pytest.raises(ValueError, match="at most 128 nodes"):
        pk.tree_verify(q, q, v, g, g, par, s0, interpret=True)
    q, v, g, par = _zeros(8, k=12)
    with pytest.raises(ValueError, match="K: .*power of two"):
        pk.tree_verify(q, q, v, g, g, par, s0, interpret=True)
    q, v, g, par = _zeros(8)
    qi = q.astype(jnp.int32)
    with pytest.raises(ValueError, match="q: .*float32, bfloat16"):
        pk.tree_verify(qi, qi, v, g, g, par, s0, interpret=True)


def test_gpu_limits_raise_before_lowering():
    """The GPU builds' shared-memory limits are ValueErrors naming the limit, raised before
    lowering (no device needed): the x3 kernel above 64 nodes; the refine kernel, dense and on
    arena states, for f32 q/k at 128 nodes with K = V = 128 and tf32x3 dots (256 KiB); the
    commit kernel for f32 keys with K 256 at 128 nodes (320 KiB)."""
    q, v, g, par = _zeros(65)
    x3 = pk.VerifyBlocks(mode="x3")
    with pytest.raises(ValueError, match="x3-mode .* at most 64 nodes"):
        pk.tree_verify(q, q, v, g, g, par, jnp.zeros((1, 1, 16, 16)), blocks=x3)
    q, v, g, par = _zeros(128, k=128, v=128)
    limit = r"128 nodes .*float32 q/k.*'tf32x3' needs 256 KiB .*227 KiB \(232448 bytes\)"
    with pytest.raises(ValueError, match=limit):
        pk.tree_verify(q, q, v, g, g, par, jnp.zeros((1, 1, 128, 128)))
    words = jnp.zeros((1, 128 * 128), jnp.uint32)
    addr = (words, jnp.zeros((1, 2), jnp.int32), jnp.zeros((1,), jnp.int32))
    with pytest.raises(ValueError, match=limit):
        verify_arena.tree_verify(q, q, v, g, g, par, *addr, state_offset=0)
    k = jnp.zeros((1, 128, 1, 256))
    path, plen = jnp.zeros((1, 128), jnp.int32), jnp.ones((1,), jnp.int32)
    with pytest.raises(ValueError, match=r"tree_commit .*320 KiB .*232448 bytes"):
        pk.tree_commit(jnp.zeros((1, 1, 256, 128)), k, v, g, path, plen)


# (npad, K, block_v, bf16 q/k, precision): bytes of jax's GPU build for sm_90
# (benchmarks/results/compile_report/verify_smem.json); the first is Nsight Compute's figure on
# the H200, the second the H200's launch error.
MEASURED_REFINE = {
    (64, 128, 64, True, "bf16x3"): 65536,
    (128, 128, 64, False, "tf32x3"): 262144,
    (128, 128, 64, True, "bf16x3"): 98304,
    (128, 128, 64, False, "bf16x3"): 131072,
    (128, 128, 64, False, "highest"): 163840,
    (64, 128, 64, False, "tf32x3"): 131072,
    (64, 256, 64, False, "tf32x3"): 262144,
    (128, 64, 64, False, "tf32x3"): 131072,
    (32, 128, 128, False, "tf32x3"): 65536,
    (128, 256, 128, True, "bf16x3"): 262144,
}


def test_shared_memory_estimates():
    """The pre-launch estimates equal the measured builds; the GPU checks pass what fits."""
    for (npad, dk, bv, low, precision), want in MEASURED_REFINE.items():
        assert refine_shared_memory(npad, dk, bv, low, precision) == want
    assert commit_shared_memory(128, 128, 64, False, "tf32x3") == 196608
    assert commit_shared_memory(128, 256, 64, False, "tf32x3") == 327680
    f32, bf16 = jnp.float32, jnp.bfloat16
    check_gpu_limits(pk.VerifyBlocks(), 64, 128, 128, f32, f32)
    check_gpu_limits(pk.VerifyBlocks(precision="bf16x3"), 128, 128, 128, bf16, bf16)
    check_gpu_limits(pk.VerifyBlocks(precision="bf16x3"), 128, 128, 128, f32, f32)
    with pytest.raises(ValueError, match="use precision='bf16x3'"):
        check_gpu_limits(pk.VerifyBlocks(), 100, 128, 128, f32, f32)


def test_route_picks_a_build_that_launches():
    """On a GPU the route keeps tf32x3 for f32 inputs up to 64 nodes and takes bf16x3 above
    (the tf32x3 build does not fit); interpret mode keeps tf32x3. ``"auto"`` takes the kernel
    only where its measured build fits."""
    s = jax.ShapeDtypeStruct

    def qkv(n, dtype, d=128):
        return s((1, n, 16, d), dtype), s((1, n, 16, d), dtype), s((1, n, 32, 128), dtype)

    pick = lambda *a, interpret=False: verify_blocks_for(*a, interpret).precision
    assert pick(*qkv(64, jnp.float32)) == "tf32x3"
    assert pick(*qkv(128, jnp.float32)) == "bf16x3"
    assert pick(*qkv(128, jnp.bfloat16)) == "bf16x3"
    assert pick(*qkv(128, jnp.float32), interpret=True) == "tf32x3"
    auto = AUTO_PALLAS["tree_verify"]
    assert auto(*qkv(64, jnp.float32)) and not auto(*qkv(64, jnp.float32, 256))


def test_interpret_runs_128_nodes():
    """Interpret mode has no shared-memory limit: f32 q/k at 128 nodes (too large for the GPU
    build at K 128) run and match float64."""
    parents = make_tree("random", 128, np.random.default_rng(5))[None]
    check_verify(parents, 1, 1, 16, 16, np.float32, True, seed=5)
