"""gdn_jax's routes to the TPU kernels (``gdn_jax.pallas_tpu_routes``): ``impl="pallas_tpu"``
of the tree verify, the commit, the chunked prefill, the token-by-token rule and the routed
experts (TPU interpret mode on CPU) give the XLA path's results, and ``impl="auto"`` takes the
TPU kernels on a TPU backend only, leaving the CPU and GPU choices as they were."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn_jax import (
    chunk_gated_delta_rule,
    dispatch,
    recurrent_gated_delta_rule,
    routed_experts,
    tree_commit,
    tree_verify,
)
from gdn_jax.dispatch import resolve_impl
from tests.gdn_jax.reference import rel_err
from tests.gdn_jax.strategies import make_inputs

TREE = np.array([[-1, 0, 0, 1, 1, 2, -1, 6, 7, -2], [-1, 0, 1, 2, 3, 4, 5, 6, 7, 8]], np.int32)


def _inputs(b, t, seed):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(x) for x in make_inputs(rng, b, t, 1, 2, 16, 16, decay="mixed"))


def test_gdn_routes_match_xla():
    q, k, v, g, beta, s0 = _inputs(*TREE.shape, seed=3)
    tree = (q, k, v, g, beta, TREE, s0)
    o, cache = tree_verify(*tree, use_qk_l2norm=True, impl="pallas_tpu")
    ox, cx = tree_verify(*tree, use_qk_l2norm=True, impl="xla")
    real = TREE >= -1
    assert rel_err(np.asarray(o)[real], np.asarray(ox)[real]) < 1e-4
    path, plen = np.array([[0, 1, 3], [0, 1, 2]], np.int32), np.array([3, 2], np.int32)
    s = tree_commit(s0, cache, path, plen, impl="pallas_tpu")
    assert rel_err(s, tree_commit(s0, cx, path, plen, impl="xla")) < 1e-4
    kw = dict(use_qk_l2norm=True)
    o1, s1 = recurrent_gated_delta_rule(q, k, v, g, beta, s0, impl="pallas_tpu", **kw)
    o2, s2 = recurrent_gated_delta_rule(q, k, v, g, beta, s0, impl="xla", **kw)
    assert rel_err(o1, o2) < 1e-5 and rel_err(s1, s2) < 1e-5
    o3, s3 = chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk_size=16, impl="pallas_tpu", **kw)
    assert rel_err(o3, o2) < 1e-4 and rel_err(s3, s2) < 1e-4


def test_moe_route_matches_xla():
    """``impl="pallas_tpu"`` of the routed experts runs jax's megablox ``gmm``; f32 weights,
    which ``gmm`` would multiply at one bf16 pass, are refused."""
    rng = np.random.default_rng(0)
    m, k, e, h, i = 5, 2, 4, 32, 48
    x = jnp.asarray(rng.standard_normal((m, h)), jnp.bfloat16)
    w = jnp.asarray(rng.uniform(0, 1, (m, k)), jnp.bfloat16)
    ids = jnp.asarray(rng.integers(0, e, (m, k)), jnp.int32)
    gate, up = (jnp.asarray(rng.standard_normal((e, h, i)) / 6, jnp.bfloat16) for _ in range(2))
    down = jnp.asarray(rng.standard_normal((e, i, h)) / 7, jnp.bfloat16)
    got = routed_experts(x, w, ids, gate, up, down, impl="pallas_tpu")
    assert rel_err(got, routed_experts(x, w, ids, gate, up, down, impl="xla")) < 1e-2
    with pytest.raises(ValueError, match="bfloat16 or float16 weights"):
        f32 = lambda a: a.astype(jnp.float32)
        routed_experts(x, w, ids, f32(gate), f32(up), f32(down), impl="pallas_tpu")


def test_auto_takes_tpu_kernels_on_tpu_only(monkeypatch):
    s = jax.ShapeDtypeStruct
    qkv = lambda n, d=128: [s((1, n, 2, d), jnp.bfloat16)] * 2 + [s((1, n, 4, d), jnp.bfloat16)]
    cache = type(
        "C", (), dict(k=s((1, 64, 2, 128), jnp.bfloat16), u=s((1, 64, 4, 128), jnp.float32))
    )
    cases = [
        ("tree_verify", qkv(64)),
        ("tree_commit", [cache]),
        ("chunk_gated_delta_rule", [*qkv(64), 64]),
        ("recurrent_gated_delta_rule", qkv(1)),
    ]
    for op, args in cases:
        assert resolve_impl("auto", op, *args) == "xla"  # CPU: unchanged
        assert resolve_impl("pallas_tpu", op, *args) == "pallas_tpu"
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    for op, args in cases:
        assert resolve_impl("auto", op, *args) == "pallas_tpu"
    assert resolve_impl("auto", "tree_verify", *qkv(129)) == "xla"
    assert resolve_impl("auto", "tree_verify", *qkv(64, d=512)) == "xla"
    assert resolve_impl("auto", "chunk_gated_delta_rule", *qkv(64), 48) == "xla"
    assert "routed_experts" not in dispatch.AUTO_TPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert resolve_impl("auto", "tree_verify", *qkv(64)) == "pallas"
    assert resolve_impl("auto", "recurrent_gated_delta_rule", *qkv(1)) == "xla"
    with pytest.raises(ValueError, match="no TPU Pallas kernel"):
        resolve_impl("pallas_tpu", "missing_op")
    with pytest.raises(ValueError, match="no Pallas kernel"):
        resolve_impl("pallas", "recurrent_gated_delta_rule")
