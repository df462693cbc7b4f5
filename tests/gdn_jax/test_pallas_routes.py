"""gdn_jax's routes to the Pallas kernels (``gdn_jax.pallas_routes``): ``impl="pallas"`` of the
tree verify, the commit and the chunked prefill (interpret mode on CPU) give the XLA path's
results, and ``impl="auto"`` takes the Pallas commit only where it was measured faster."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn_jax import chunk_gated_delta_rule, tree_commit, tree_verify
from gdn_jax.dispatch import AUTO_PALLAS
from gdn_jax.pallas_routes import AUTO_COMMIT_MIN_ROWS
from tests.gdn_jax.reference import rel_err
from tests.gdn_jax.strategies import make_inputs

# row 0: a forest (two roots) with a padding node; row 1: a chain
FIXED_TREE = np.array(
    [[-1, 0, 0, 1, 1, 2, -1, 6, 7, -2], [-1, 0, 1, 2, 3, 4, 5, 6, 7, 8]], np.int32
)


def _inputs(b, t, seed):
    """Random f32 ``q, k [B, T, 1, 16]``, ``v [B, T, 2, 16]``, ``g, beta [B, T, 2]``, ``S0``."""
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(x) for x in make_inputs(rng, b, t, 1, 2, 16, 16))


def test_routes_match_xla():
    """``impl="pallas"`` goes through gdn_jax.pallas_routes (interpret mode on CPU)."""
    q, k, v, g, beta, s0 = _inputs(*FIXED_TREE.shape, seed=3)
    tree = (q, k, v, g, beta, FIXED_TREE, s0)
    o, cache = tree_verify(*tree, use_qk_l2norm=True, impl="pallas")
    ox, cx = tree_verify(*tree, use_qk_l2norm=True, impl="xla")
    real = FIXED_TREE >= -1
    assert rel_err(np.asarray(o)[real], np.asarray(ox)[real]) < 2e-5
    path, plen = np.array([[0, 1, 3], [0, 1, 2]], np.int32), np.array([3, 2], np.int32)
    s = tree_commit(s0, cache, path, plen, impl="pallas")
    sx = tree_commit(s0, cx, path, plen, impl="xla")
    assert rel_err(s, sx) < 2e-5


def test_verify_route_on_a_deep_chain_of_alike_keys():
    """A 64-node chain of nearly equal bf16 keys with slow decay: ``impl="pallas"`` (on a GPU
    the kernel's one-pass bf16 inverse, which needs the block inverse beyond depth 16) against
    the XLA path's triangular solve. On CPU interpret mode runs f32 dots, so this is the GPU's
    check (``benchmarks/device.sh gpu_tests``)."""
    parents = (np.arange(64, dtype=np.int32) - 1)[None]
    rng = np.random.default_rng(1)
    q, k, v, g, beta, s0 = make_inputs(rng, 1, 64, 1, 2, 64, 64)
    k = rng.normal(size=64) + 0.03 * rng.normal(size=k.shape)
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)
    tree = (bf(q), bf(k), bf(v), jnp.asarray(0.01 * g), jnp.asarray(np.minimum(2 * beta, 1)))
    tree += (parents, jnp.asarray(s0))
    _, cache = tree_verify(*tree, use_qk_l2norm=True, impl="pallas")
    _, cx = tree_verify(*tree, use_qk_l2norm=True, impl="xla")
    assert rel_err(cache.u, cx.u) < 2e-5, rel_err(cache.u, cx.u)


@pytest.mark.parametrize("final", [True, False])
def test_chunk_route_matches_xla(final):
    """``impl="pallas"`` of the chunked prefill goes to the three-kernel prefill (interpret)."""
    q, k, v, g, beta, _ = _inputs(1, 40, seed=8)
    cu = jnp.asarray([0, 7, 40], jnp.int32)
    s0 = jnp.asarray(np.random.default_rng(9).normal(size=(2, 2, 16, 16)), jnp.float32)
    kw = dict(use_qk_l2norm=True, chunk_size=16, cu_seqlens=cu, output_final_state=final)
    o, sf = chunk_gated_delta_rule(q, k, v, g, beta, s0, impl="pallas", **kw)
    ox, sx = chunk_gated_delta_rule(q, k, v, g, beta, s0, impl="xla", **kw)
    assert rel_err(o, ox) < 2e-5
    if final:
        assert rel_err(sf, sx) < 2e-5
    else:
        assert sf is None and sx is None


def test_auto_commit_route_thresholds():
    """``impl="auto"`` on GPU takes the Pallas commit only for N <= 64 and B x Hv >= 1024 rows
    (where the H200 timed it faster than XLA)."""

    def cache(b, n, hv):
        k = jax.ShapeDtypeStruct((b, n, 16, 128), jnp.bfloat16)
        u = jax.ShapeDtypeStruct((b, n, hv, 128), jnp.float32)
        return types.SimpleNamespace(k=k, u=u)

    fits = AUTO_PALLAS["tree_commit"]
    assert AUTO_COMMIT_MIN_ROWS == 1024
    assert fits(cache(64, 64, 32)) and fits(cache(16, 64, 64))
    assert not fits(cache(1, 64, 64)) and not fits(cache(16, 64, 32))
    assert not fits(cache(64, 128, 32))


def test_auto_predicates_take_only_kernel_shapes():
    """``"auto"`` never routes a shape the kernels reject: head dims outside [16, 256] or not
    powers of two stay on XLA, as do MoE hidden sizes that are not multiples of 16; the MoE
    predicate takes the small-M kernel's shapes and, above its pair limit, the grouped
    kernel's."""
    s = jax.ShapeDtypeStruct
    qkv = lambda n, d: [s((1, n, 2, d), jnp.bfloat16)] * 3
    verify = AUTO_PALLAS["tree_verify"]
    assert verify(*qkv(64, 128)) and verify(*qkv(64, 256))
    assert not verify(*qkv(64, 512)) and not verify(*qkv(64, 96)) and not verify(*qkv(128, 128))
    chunk = AUTO_PALLAS["chunk_gated_delta_rule"]
    assert chunk(*qkv(64, 128), 64) and not chunk(*qkv(64, 128), 128)
    assert not chunk(*qkv(64, 512), 64)

    def moe(m, k, h, i, e=8):
        x, w = s((m, h), jnp.bfloat16), s((m, k), jnp.bfloat16)
        ids = s((m, k), jnp.int32)
        gu, d = s((e, h, i), jnp.bfloat16), s((e, i, h), jnp.bfloat16)
        return AUTO_PALLAS["routed_experts"](x, w, ids, gu, gu, d)

    assert moe(1, 8, 2048, 512) and moe(16, 8, 2048, 512) and moe(2048, 8, 2048, 512)
    assert not moe(1, 8, 2040, 512) and not moe(2048, 8, 2048, 520)


def test_moe_grouped_tiles_by_pairs_and_dtype():
    """The grouped MoE kernels' tiles: 32-row blocks up to ``MOE_FEW_PAIRS`` pairs and 128-row
    blocks beyond for 2-byte weights; float32 weights keep the default tiles (the wide ones'
    stages would exceed an H200 block's shared memory)."""
    from gdn_jax import pallas_routes as pr

    ids = lambda m: jax.ShapeDtypeStruct((m, 8), jnp.int32)
    few = pr.MOE_FEW_PAIRS // 8
    assert pr._moe_grouped_blocks(ids(few), jnp.bfloat16).block_m == 32
    assert pr._moe_grouped_blocks(ids(few + 1), jnp.bfloat16).block_m == 128
    assert pr._moe_grouped_blocks(ids(few), jnp.float16) is pr.MOE_GROUPED_FEW
    for m in (few, few + 1):
        assert pr._moe_grouped_blocks(ids(m), jnp.float32) is pr.MOE_GROUPED
