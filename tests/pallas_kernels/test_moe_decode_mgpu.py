"""The Mosaic GPU decode kernel (``pallas_kernels/moe/decode_mgpu.py``) in Mosaic GPU's interpret
mode: against float64 and against the Triton decode kernel (same contract, same roundings),
with and without the shared term, through the ring's depths; its checks; its route."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.moe as moe
from gdn_jax import pallas_routes
from gdn_jax.moe import routed_experts
from tests.gdn_jax.test_moe import make_experts, make_routing, rel_err, routed64

E, H, I, I_S = 8, 256, 128, 128  # I and I_s: two 64-column tiles; H: four 64-row steps
TRITON = moe.DecodeBlocks(block_i=16, block_k=16, block_h=16, block_hs=16)


def inputs(kind: str, m: int, k: int, seed: int, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    experts, weights = make_routing(kind, m, k, E, rng)
    experts[0, -1] = E + 3  # out of range: contributes nothing
    if m > 1:
        experts[m - 1, 0] = -1
    return (
        jnp.asarray(rng.normal(size=(m, H)), dtype),
        jnp.asarray(weights, dtype),
        jnp.asarray(experts),
        *make_experts(rng, E, H, I, dtype),
    )


def ref64(x, weights, experts, gate, up, down) -> np.ndarray:
    """float64 ``out``, the pairs with ids outside ``[0, E)`` dropped."""
    ex = np.asarray(experts)
    bad = (ex < 0) | (ex >= E)
    w = np.where(bad, 0.0, np.asarray(weights, np.float64))
    return routed64(x, w, np.where(bad, 0, ex), gate, up, down)


def shared_term(form: str | None, m: int, seed: int, dtype=jnp.bfloat16):
    """``(shared argument, float64 h_s)`` of a form: None, ``"pair"`` or ``"glu"``."""
    if form is None:
        return None, None
    rng = np.random.default_rng(seed + 100)
    w_s = jnp.asarray(rng.normal(size=(H, I_S)) / np.sqrt(I_S), dtype)
    if form == "pair":
        h_s = jnp.asarray(rng.normal(size=(m, I_S)), dtype)
        return (h_s, w_s), np.asarray(h_s, np.float64)
    act = jnp.asarray(rng.normal(size=(m, 5 + 2 * I_S)), dtype)
    a = np.asarray(act, np.float64)
    g, u, z = a[:, 4 : 4 + I_S], a[:, 4 + I_S : 4 + 2 * I_S], a[:, 3:4]
    h_s = g / (1 + np.exp(-g)) * u / (1 + np.exp(-z))
    return moe.SharedGLU(act, w_s, gate_col=4, up_col=4 + I_S, logit_col=3), h_s


@pytest.mark.parametrize(
    "m, k, form, blocks",
    [
        (1, 3, None, moe.MgpuDecodeBlocks()),  # ring deeper than the 6 loads
        (2, 4, "pair", moe.MgpuDecodeBlocks(stages=3)),
        (4, 2, "glu", moe.MgpuDecodeBlocks(stages=1)),  # one slot: no deferred wait
        (8, 2, None, moe.MgpuDecodeBlocks(stages=2, defer_wait=False)),
        (3, 8, "glu", moe.MgpuDecodeBlocks(stages=5)),
    ],
)
def test_matches_float64_and_the_triton_kernel(m, k, form, blocks):
    args = inputs("random", m, k, seed=m * 10 + k)
    shared, h_s = shared_term(form, m, seed=m)
    out = moe.routed_experts_decode_mgpu(*args, shared, blocks=blocks, interpret=True)
    chex.assert_shape(out, (m, H))
    chex.assert_type(out, jnp.bfloat16)
    ref = ref64(*args)
    if shared is not None:
        ref = ref + h_s @ np.asarray(moe.decode.shared_weight(shared), np.float64).T
    assert rel_err(out, ref) < 1e-2, rel_err(out, ref)
    triton = moe.routed_experts_decode(*args, shared, blocks=TRITON, interpret=True)
    # both round each pair's activation to bf16 and sum in f32; only the order of the f32
    # sums differs, so they agree to about one bf16 rounding of the output
    assert rel_err(out, np.asarray(triton, np.float64)) < 3e-3


def test_routing_weights_and_ids_matter():
    """Changing one pair's weight or expert changes only its token's row."""
    args = list(inputs("random", 2, 3, seed=1))
    base = np.asarray(moe.routed_experts_decode_mgpu(*args, interpret=True), np.float64)
    w = args[1].at[1, 1].multiply(3.0)  # (pair (1, 0) has an out-of-range id)
    out = np.asarray(moe.routed_experts_decode_mgpu(args[0], w, *args[2:], interpret=True))
    assert np.allclose(out[0], base[0]) and not np.allclose(out[1], base[1], atol=1e-2)
    ex = args[2].at[0, 0].set((args[2][0, 0] + 1) % E)
    out = np.asarray(moe.routed_experts_decode_mgpu(*args[:2], ex, *args[3:], interpret=True))
    assert np.allclose(out[1], base[1]) and not np.allclose(out[0], base[0], atol=1e-2)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(dtype=jnp.float32), "^gate: the Mosaic GPU decode kernel takes bfloat16 or float16"),
        (dict(i=96), "^gate: the Mosaic GPU decode kernel needs I a multiple of 64 and H of 128"),
        (dict(h=192), "^gate: the Mosaic GPU decode kernel needs I a multiple"),
        (dict(m=9), "^experts: the Mosaic GPU decode kernel takes at most 8 tokens"),
        (dict(k=5, max_pairs=8), r"^experts: .* 8 token-expert pairs \(M \* k\), got 2 \* 5"),
        (dict(w_s_dtype=jnp.float32), "^shared: w_s must have gate's dtype bfloat16"),
        (dict(interpret=False), "^impl: the Mosaic GPU decode kernel needs a compute capability"),
    ],
)
def test_checks(change, match):
    m, k, h, i = change.get("m", 2), change.get("k", 2), change.get("h", H), change.get("i", I)
    dtype = change.get("dtype", jnp.bfloat16)
    rng = np.random.default_rng(0)
    args = (
        jnp.ones((m, h), dtype),
        jnp.ones((m, k), dtype),
        jnp.zeros((m, k), jnp.int32),
        *make_experts(rng, E, h, i, dtype),
    )
    shared = None
    if "w_s_dtype" in change:
        shared = (jnp.ones((m, I_S), dtype), jnp.ones((h, I_S), change["w_s_dtype"]))
    blocks = moe.MgpuDecodeBlocks(max_pairs=change.get("max_pairs", 64))
    with pytest.raises(ValueError, match=match):
        moe.routed_experts_decode_mgpu(
            *args, shared, blocks=blocks, interpret=change.get("interpret", True)
        )


@pytest.mark.parametrize(
    "kw, match", [(dict(stages=0), "^stages: an int in"), (dict(max_pairs=0), "^max_pairs")]
)
def test_knob_checks(kw, match):
    with pytest.raises(ValueError, match=match):
        moe.MgpuDecodeBlocks(**kw)


def test_route_takes_it_when_switched_on(monkeypatch):
    """``pallas_routes.MOE_DECODE_MGPU`` sends the one-token decode route (with its
    ``SharedGLU``) to the Mosaic GPU kernel; off (the default) it stays on the Triton one, and
    float32 weights stay there too."""
    calls = []
    real = moe.routed_experts_decode_mgpu

    def spy(*a, **kw):
        calls.append(kw["blocks"])
        return real(*a, **kw)

    monkeypatch.setattr(pallas_routes.moe_kernels, "routed_experts_decode_mgpu", spy)
    args = inputs("random", 1, 2, seed=3)
    shared, h_s = shared_term("glu", 1, seed=3)
    ref = ref64(*args) + h_s @ np.asarray(shared.w_s, np.float64).T
    off = routed_experts(*args, impl="pallas", shared=shared)
    assert calls == [] and rel_err(off, ref) < 1e-2
    monkeypatch.setattr(pallas_routes, "MOE_DECODE_MGPU", True)
    on = routed_experts(*args, impl="pallas", shared=shared)
    assert calls == [pallas_routes.MOE_DECODE_MGPU_BLOCKS] and rel_err(on, ref) < 1e-2
    f32 = [a if a.dtype == jnp.int32 else a.astype(jnp.float32) for a in args]
    routed_experts(*f32, impl="pallas")
    assert len(calls) == 1
    jax.block_until_ready(on)
