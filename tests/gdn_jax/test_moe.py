"""The routed-experts op ``gdn_jax.routed_experts``: both paths against a float64 per-pair
reference over random, skewed, empty-expert, one-token, duplicate-id and tied-weight routings;
``SparseMoE`` through the op; input validation.
The Pallas path runs in interpret mode on CPU."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from gdn_jax import balanced_route, route_topk, routed_experts
from gdn_jax.models import set_moe_routing
from gdn_jax.models.moe import SparseMoE

E, H, I, K = 6, 16, 32, 3  # experts, hidden, intermediate, experts per token
ROUTINGS = ("random", "skewed", "all_one", "empty", "ties", "duplicates")
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


# ------------------------------------------------------------------------------ references


def routed64(x, weights, experts, gate, up, down) -> np.ndarray:
    """``out [M, H]`` in float64, pair by pair:
    ``sum_j w[m, j] * (silu(x[m] G_e) * (x[m] U_e)) D_e`` with ``e = experts[m, j]``."""
    x, weights, gate, up, down = (np.asarray(a, np.float64) for a in (x, weights, gate, up, down))
    experts = np.asarray(experts)
    out = np.zeros((x.shape[0], down.shape[2]))
    for m in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = experts[m, j]
            g, u = x[m] @ gate[e], x[m] @ up[e]
            out[m] += weights[m, j] * ((g / (1.0 + np.exp(-g)) * u) @ down[e])
    return out


# --------------------------------------------------------------------------------- inputs


def make_routing(kind: str, m: int, k: int, e: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """``(experts int32 [m, k], weights f32 [m, k])`` of a routing kind:

    random (distinct experts per token, softmax-top-k weights), skewed (every token's first
    choice is expert 0), all_one (every pair on expert 0, ids repeated within a token), empty
    (only experts ``0..k-1`` used), ties (equal weights ``1/k``), duplicates (ids drawn with
    replacement)."""
    distinct = np.stack([rng.permutation(e)[:k] for _ in range(m)])
    if kind == "skewed":
        others = np.stack([1 + rng.permutation(e - 1)[: k - 1] for _ in range(m)])
        ids = np.concatenate([np.zeros((m, 1), int), others], axis=1)
    elif kind == "all_one":
        ids = np.zeros((m, k), int)
    elif kind == "empty":
        ids = np.stack([rng.permutation(k) for _ in range(m)])
    elif kind == "duplicates":
        ids = rng.integers(0, e, (m, k))
    else:
        ids = distinct
    logits = rng.normal(size=(m, k))
    w = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    if kind == "ties":
        w = np.full((m, k), 1.0 / k)
    return ids.astype(np.int32), w.astype(np.float32)


def make_experts(rng, e=E, h=H, i=I, dtype=jnp.float32):
    """``gate, up [e, h, i]`` and ``down [e, i, h]`` with unit-scale outputs."""
    gate = rng.normal(size=(e, h, i)) / np.sqrt(h)
    up = rng.normal(size=(e, h, i)) / np.sqrt(h)
    down = rng.normal(size=(e, i, h)) / np.sqrt(i)
    return tuple(jnp.asarray(a, dtype) for a in (gate, up, down))


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check_against_f64(kind, m, seed, impl, dtype):
    rng = np.random.default_rng(seed)
    experts, weights = make_routing(kind, m, K, E, rng)
    x = jnp.asarray(rng.normal(size=(m, H)), dtype)
    gate, up, down = make_experts(rng, dtype=dtype)
    w = jnp.asarray(weights, dtype)
    out = routed_experts(x, w, experts, gate, up, down, impl=impl)
    chex.assert_shape(out, (m, H))
    chex.assert_type(out, dtype)
    ref = routed64(x.astype(jnp.float32), w.astype(jnp.float32), experts, gate, up, down)
    assert rel_err(out, ref) < TOL[dtype], (kind, m, impl, rel_err(out, ref))


# ---------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kind", ROUTINGS)
def test_routings_match_float64(kind, dtype, impl):
    check_against_f64(kind, 5, 0, impl, dtype)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_one_token(impl):
    check_against_f64("random", 1, 1, impl, jnp.float32)


def test_pallas_many_tokens():
    """``M * k`` past the small-M kernel's pair limit (256) routes to the grouped kernels."""
    check_against_f64("skewed", 90, 5, "pallas", jnp.float32)


@pytest.mark.parametrize("impl", ["xla", "pallas", "pallas_tpu"])
def test_out_of_range_ids_are_dropped(impl):
    """Pairs whose expert id lies outside ``[0, E)`` (``-1``, ``E``, far past: what expert
    parallelism hands a device for other devices' experts) add nothing on every path: the
    result is float64's with those pairs removed, and differs from keeping them."""
    rng = np.random.default_rng(11)
    m = 7
    experts, weights = make_routing("duplicates", m, K, E, rng)
    dtype = jnp.bfloat16 if impl == "pallas_tpu" else jnp.float32  # gmm takes 2-byte weights
    x = jnp.asarray(rng.normal(size=(m, H)), dtype)
    gate, up, down = make_experts(rng, dtype=dtype)
    drop = rng.random(experts.shape) < 0.4
    drop[0] = True  # a token with every pair dropped
    bad = np.where(drop, rng.choice([-1, E, 4 * E], experts.shape), experts).astype(np.int32)
    w = jnp.asarray(weights, dtype)
    out = routed_experts(x, w, bad, gate, up, down, impl=impl)
    f32 = lambda a: jnp.asarray(a).astype(jnp.float32)
    kept = routed64(f32(x), np.where(drop, 0.0, f32(w)), np.where(drop, 0, experts), gate, up, down)
    every = routed64(f32(x), f32(w), experts, gate, up, down)
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    assert rel_err(out, kept) < tol, rel_err(out, kept)
    assert rel_err(out, every) > 10 * tol
    assert not np.asarray(out[0], np.float32).any()


@settings(max_examples=20, deadline=None)
@given(
    kind=st.sampled_from(ROUTINGS),
    m=st.sampled_from([1, 4]),
    seed=st.integers(0, 2**31 - 1),
    impl=st.sampled_from(["xla", "pallas"]),
)
def test_random_routings(kind, m, seed, impl):
    """Hypothesis over routing kinds and seeds (shapes fixed, so each path compiles once per
    ``M``)."""
    check_against_f64(kind, m, seed, impl, jnp.float32)


def test_paths_agree_under_jit():
    """Inside ``jax.jit`` (as in the model) the two paths agree, and the op's output equals the
    unjitted call."""
    rng = np.random.default_rng(3)
    experts, weights = make_routing("duplicates", 8, K, E, rng)
    x = jnp.asarray(rng.normal(size=(8, H)), jnp.float32)
    args = (x, weights, experts, *make_experts(rng))
    out = {
        impl: jax.jit(functools.partial(routed_experts, impl=impl))(*args)
        for impl in ("xla", "pallas")
    }
    np.testing.assert_allclose(out["pallas"], out["xla"], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(routed_experts(*args, impl="xla"), out["xla"])


def tiny_moe(dtype, seed=0) -> SparseMoE:
    return SparseMoE(
        H,
        num_experts=E,
        top_k=K,
        intermediate=I,
        shared_intermediate=16,
        norm_topk_prob=True,
        dtype=dtype,
        rngs=nnx.Rngs(seed),
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_sparse_moe_call_is_routed_plus_gated_shared(dtype):
    """``SparseMoE.__call__`` = the routed experts (``routed_experts`` on the router's top-k)
    plus the sigmoid-gated shared expert, bit for bit, jitted; output in the input's dtype.
    Both sides on the XLA path (on a GPU "auto" would route the block to the kernels)."""
    moe = tiny_moe(dtype)
    moe.impl = "xla"
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 7, H)), dtype)
    params = (moe.gate_proj[...], moe.up_proj[...], moe.down_proj[...])

    def parts(m, x):
        xs = x.reshape(-1, H)
        w, e = m.route(xs)
        out = routed_experts(xs, w, e, *params, impl="xla")
        shared = jax.nn.sigmoid(m.shared_expert_gate(xs)) * m.shared_expert(xs)
        return (out + shared).astype(x.dtype).reshape(x.shape)

    got = nnx.jit(lambda m, x: m(x))(moe, x)
    want = nnx.jit(parts)(moe, x)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    chex.assert_type(got, dtype)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_sparse_moe_matches_float64(impl):
    """The block's routed part through the model's router, against float64."""
    moe = tiny_moe(jnp.float32, seed=2)
    moe.impl = impl
    x = jnp.asarray(np.random.default_rng(2).normal(size=(6, H)), jnp.float32)
    weights, experts = moe.route(x)
    params = (moe.gate_proj[...], moe.up_proj[...], moe.down_proj[...])
    got = moe.routed(x, weights, experts)
    assert rel_err(got, routed64(x, weights, experts, *params)) < 1e-5


def _route64(logits, k, norm):
    """HF's rule in float64: softmax over every expert, its top-k (ties to the lower id),
    renormalised when ``norm``."""
    logits = np.asarray(logits, np.float64)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    top = np.take_along_axis(p, ids, -1)
    return (top / top.sum(-1, keepdims=True) if norm else top), ids


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("m, e, k", [(1, 256, 8), (5, 6, 2), (3, 48, 10)])
@pytest.mark.parametrize("norm", [True, False])
def test_route_topk_matches_float64(impl, m, e, k, norm):
    """``route_topk`` (the XLA path and the one-kernel Pallas path, interpret mode) against
    float64, on random logits; bf16 logits too for the kernel path."""
    rng = np.random.default_rng(m * e + k)
    logits = rng.standard_normal((m, e)).astype(np.float32) * 3.0
    for dtype in (jnp.float32, jnp.bfloat16) if impl == "pallas" else (jnp.float32,):
        x = jnp.asarray(logits, dtype)
        weights, ids = route_topk(x, k, normalize=norm, impl=impl)
        chex.assert_shape([weights, ids], (m, k))
        chex.assert_type([weights, ids], [jnp.float32, jnp.int32])
        w64, i64 = _route64(np.asarray(x, np.float32), k, norm)
        np.testing.assert_array_equal(ids, i64)
        np.testing.assert_allclose(weights, w64, rtol=2e-6, atol=1e-7)


def test_route_topk_nan_logits_keep_ids_in_range():
    """NaN logits (a diverged hidden state) still give distinct expert ids in ``[0, E)``, the
    kernel's equal to ``lax.top_k``'s (a NaN ranks above every number), with NaN weights; an
    out-of-range id would send the expert kernels past the weights."""
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((3, 40)).astype(np.float32)
    logits[0] = np.nan  # a whole row
    logits[1, [5, 17]] = np.nan  # two experts of a row
    x = jnp.asarray(logits)
    w_x, i_x = route_topk(x, 4, impl="xla")
    w_p, i_p = route_topk(x, 4, impl="pallas")
    np.testing.assert_array_equal(i_p, i_x)
    assert np.all((np.asarray(i_p) >= 0) & (np.asarray(i_p) < 40))
    assert all(len(set(row)) == 4 for row in np.asarray(i_p).tolist())
    np.testing.assert_array_equal(np.asarray(i_p)[1, :2], [5, 17])
    assert np.isnan(np.asarray(w_p)[:2]).all() and np.isfinite(np.asarray(w_p)[2]).all()
    np.testing.assert_allclose(w_p[2], w_x[2], rtol=2e-6)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_route_topk_reads_the_first_columns(impl):
    """``num_experts``: the router's logits as the first ``E`` columns of a wider array (a
    fused projection's output) route as the sliced logits do, bit for bit."""
    wide = jnp.asarray(np.random.default_rng(9).standard_normal((3, 48 + 21)), jnp.bfloat16)
    w1, i1 = route_topk(wide[:, :48], 6, impl=impl)
    w2, i2 = route_topk(wide, 6, impl=impl, num_experts=48)
    np.testing.assert_array_equal(i2, i1)
    np.testing.assert_array_equal(w2, w1)


@pytest.mark.parametrize(
    "args, kw, name",
    [((np.zeros(8, np.float32), 2), {}, "logits"), ((np.zeros((2, 8), np.float32), 9), {}, "k"),
     ((np.zeros((2, 8), np.float32), 0), {}, "k"),
     ((np.zeros((2, 8), np.float32), 2), {"num_experts": 9}, "num_experts"),
     ((np.zeros((2, 8), np.float32), 5), {"num_experts": 4}, "k")],
)  # fmt: skip
def test_route_topk_bad_inputs_raise(args, kw, name):
    for impl in ("xla", "pallas"):
        with pytest.raises(ValueError, match=f"^{name}"):
            route_topk(*args, impl=impl, **kw)


@pytest.mark.parametrize("norm", [True, False])
def test_router_matches_float64_softmax_topk(norm):
    """The router's ids and weights equal HF's rule in float64 (softmax over all experts, its
    top-k, renormalised when ``norm_topk_prob``), on random router weights and inputs."""
    moe = tiny_moe(jnp.float32, seed=5)
    moe.norm_topk_prob = norm
    rng = np.random.default_rng(5)
    moe.gate.weight[...] = jnp.asarray(rng.normal(size=moe.gate.weight.shape), jnp.float32)
    x = jnp.asarray(rng.normal(size=(9, H)), jnp.float32)
    weights, experts = moe.route(x)
    logits = np.asarray(x, np.float64) @ np.asarray(moe.gate.weight[...], np.float64).T
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :K]
    top = np.take_along_axis(p, ids, -1)
    if norm:
        top /= top.sum(-1, keepdims=True)
    np.testing.assert_array_equal(experts, ids)
    np.testing.assert_allclose(weights, top, rtol=1e-5, atol=1e-7)
    chex.assert_type([weights, experts], [jnp.float32, jnp.int32])


def test_router_ties():
    """A zero router gives tied probabilities: ``top_k`` takes experts ``0..k-1`` with equal
    weights ``1/k``, and the routed sum equals float64."""
    moe = tiny_moe(jnp.float32, seed=4)
    moe.gate.weight[...] = jnp.zeros_like(moe.gate.weight[...])
    x = jnp.asarray(np.random.default_rng(4).normal(size=(3, H)), jnp.float32)
    weights, experts = moe.route(x)
    np.testing.assert_array_equal(experts, np.tile(np.arange(K), (3, 1)))
    np.testing.assert_allclose(weights, np.full((3, K), 1.0 / K), rtol=1e-6)
    params = (moe.gate_proj[...], moe.up_proj[...], moe.down_proj[...])
    for impl in ("xla", "pallas"):
        got = routed_experts(x, weights, experts, *params, impl=impl)
        assert rel_err(got, routed64(x, weights, experts, *params)) < 1e-5


def test_zero_tokens():
    args = (np.zeros((0, H), np.float32), np.zeros((0, K), np.float32), np.zeros((0, K), np.int32))
    for impl in ("xla", "pallas", "auto"):
        out = routed_experts(*args, *make_experts(np.random.default_rng(0)), impl=impl)
        chex.assert_shape(out, (0, H))


def _valid_args():
    rng = np.random.default_rng(0)
    experts, weights = make_routing("random", 4, K, E, rng)
    x = jnp.asarray(rng.normal(size=(4, H)), jnp.float32)
    g, u, d = make_experts(rng)
    return dict(x=x, weights=weights, experts=experts, g=g, u=u, d=d)


BAD = [
    ("x", dict(x=np.zeros((4, H, 1), np.float32))),
    ("x", dict(x=np.zeros((4, H), np.int32))),
    ("gate_proj", dict(g=np.zeros((E, H + 1, I), np.float32))),
    ("gate_proj", dict(g=np.zeros((H, I), np.float32))),
    ("up_proj", dict(u=np.zeros((E, H, I + 1), np.float32))),
    ("up_proj", dict(u=np.zeros((E, H, I), jnp.bfloat16))),
    ("down_proj", dict(d=np.zeros((E, H, I), np.float32))),
    ("experts", dict(experts=np.zeros((4, K), np.float32))),
    ("experts", dict(experts=np.zeros((5, K), np.int32))),
    ("experts", dict(experts=np.zeros((4, E + 1), np.int32), weights=np.zeros((4, E + 1)))),
    ("weights", dict(weights=np.zeros((4, K + 1), np.float32))),
    ("weights", dict(weights=np.zeros((4, K), np.int32))),
]


@pytest.mark.parametrize("name, change", BAD)
def test_validation_names_the_argument(name, change):
    a = {**_valid_args(), **change}
    with pytest.raises(ValueError, match=f"^{name}:"):
        routed_experts(a["x"], a["weights"], a["experts"], a["g"], a["u"], a["d"], impl="xla")


def test_unknown_impl():
    a = _valid_args()
    with pytest.raises(ValueError, match="^impl:"):
        routed_experts(a["x"], a["weights"], a["experts"], a["g"], a["u"], a["d"], impl="cuda")


def test_pallas_rejects_shapes_before_launch():
    """``impl="pallas"`` raises ``ValueError`` for a hidden size the kernels cannot tile."""
    rng = np.random.default_rng(0)
    experts, weights = make_routing("random", 2, K, E, rng)
    gate, up, down = make_experts(rng, h=24)
    x = jnp.ones((2, 24), jnp.float32)
    with pytest.raises(ValueError, match="^H:"):
        routed_experts(x, weights, experts, gate, up, down, impl="pallas")
    out = routed_experts(x, weights, experts, gate, up, down, impl="auto")  # XLA on CPU
    chex.assert_shape(out, (2, 24))


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("norm", [True, False])
def test_balanced_route_spreads_rows_like_uniform_routing(impl, norm):
    """``balanced_route`` (the XLA path and the one-kernel Pallas path, interpret mode): ``k``
    distinct in-range ids per row, whatever the logits (here every row's logits equal, which
    the router's top-k would send to the same ``k`` experts); over ``M`` rows about
    ``E (1 - (1 - k/E)^M)`` experts touched, as uniform routing; the weights are
    ``route_topk``'s rule applied to the logits at those ids, against float64."""
    e, k = 256, 8
    rng = np.random.default_rng(3)
    one = rng.standard_normal(e).astype(np.float32) * 2.0
    for m in (1, 16, 64, 256):
        logits = jnp.asarray(np.broadcast_to(one, (m, e)))
        route = functools.partial(balanced_route, k=k, normalize=norm, impl=impl)
        w, ids = jax.jit(route)(logits)
        chex.assert_shape([w, ids], (m, k))
        chex.assert_type([w, ids], [jnp.float32, jnp.int32])
        ids = np.asarray(ids)
        assert ids.min() >= 0 and ids.max() < e
        assert all(len(set(r)) == k for r in ids.tolist())
        expect = e * (1 - (1 - k / e) ** m)
        assert abs(len(np.unique(ids)) - expect) <= 0.15 * expect + k, (m, len(np.unique(ids)))
        picked = np.take_along_axis(np.asarray(logits, np.float64), ids, axis=1)
        if norm:
            w64 = np.exp(picked - picked.max(1, keepdims=True))
            w64 /= w64.sum(1, keepdims=True)
        else:
            full = np.asarray(logits, np.float64)
            w64 = np.exp(picked - full.max(1, keepdims=True))
            w64 /= np.exp(full - full.max(1, keepdims=True)).sum(1, keepdims=True)
        np.testing.assert_allclose(w, w64, rtol=2e-6, atol=1e-7)
    # the router's own top-k puts all these rows on one set of k experts
    assert len(np.unique(np.asarray(route_topk(logits, k, impl="xla")[1]))) == k


@pytest.mark.parametrize("e, k", [(256, 8), (512, 10)])
@pytest.mark.parametrize("norm", [True, False])
def test_balanced_route_kernel_matches_xla(e, k, norm):
    """The one-kernel Pallas path (interpret mode on CPU) takes the XLA path's ids exactly and its
    weights to ~1e-6, on random f32 and bf16 logits (``E`` not a multiple of ``k`` too), also
    from the first ``E`` columns of a wider array (``num_experts``); a NaN row still takes its
    class's ids."""
    rng = np.random.default_rng(e + k + norm)
    for m in (1, 5):
        raw = rng.standard_normal((m, e + 19)).astype(np.float32) * 3.0
        if m == 5:
            raw[-1] = np.nan  # a diverged row: NaN weights, its class's ids
        for dtype in (jnp.float32, jnp.bfloat16):
            wide = jnp.asarray(raw, dtype)
            w_x, i_x = balanced_route(wide[:, :e], k, normalize=norm, impl="xla")
            calls = [((wide, k), {"num_experts": e})]
            if dtype == jnp.float32:
                calls.append(((wide[:, :e], k), {}))
            for args, kw in calls:
                w, ids = balanced_route(*args, normalize=norm, impl="pallas", **kw)
                chex.assert_shape([w, ids], (m, k))
                chex.assert_type([w, ids], [jnp.float32, jnp.int32])
                np.testing.assert_array_equal(ids, i_x)
                np.testing.assert_allclose(w, w_x, rtol=2e-6, atol=1e-7)
    assert np.isnan(np.asarray(w_x)[-1]).all() and np.isfinite(np.asarray(w_x)[:-1]).all()
    w_b, _ = balanced_route(wide, k, normalize=norm, dtype=jnp.bfloat16, impl="pallas",
                            num_experts=e)  # fmt: skip
    chex.assert_type(w_b, jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(w_b, np.float32), np.asarray(w_x), rtol=4e-3, atol=1e-7)


def test_balanced_route_bad_inputs_raise():
    for impl in ("xla", "pallas"):
        with pytest.raises(ValueError, match="^k"):
            balanced_route(np.zeros((2, 10), np.float32), 11, impl=impl)
        with pytest.raises(ValueError, match="^logits"):
            balanced_route(np.zeros(8, np.float32), 2, impl=impl)
        for e in (0, 11, 4.0):
            with pytest.raises(ValueError, match="^num_experts"):
                balanced_route(np.zeros((2, 10), np.float32), 2, impl=impl, num_experts=e)
        with pytest.raises(ValueError, match="^k"):
            balanced_route(np.zeros((2, 10), np.float32), 5, impl=impl, num_experts=4)
    # E not a multiple of k (Qwen3-Next: 512 experts, top-10): distinct in-range ids
    ids = np.asarray(balanced_route(np.zeros((64, 512), np.float32), 10)[1])
    assert ids.min() >= 0 and ids.max() < 510
    assert all(len(set(r)) == 10 for r in ids.tolist())


def test_set_moe_routing_switches_the_block():
    """``set_moe_routing(model, "balanced")`` makes the block route by ``balanced_route`` (the
    block's output then equals the routed experts on those ids plus the shared expert), and
    ``"model"`` restores the router's top-k; other values raise."""
    moe = tiny_moe(jnp.float32, seed=4)
    x = jnp.asarray(np.random.default_rng(4).normal(size=(5, H)), jnp.float32)
    before = moe(x)
    set_moe_routing(moe, "balanced")
    w, ids = moe.route(x)
    want_w, want_ids = balanced_route(moe.gate(x), K, normalize=True, dtype=jnp.float32)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(w, want_w)
    shared = jax.nn.sigmoid(moe.shared_expert_gate(x)) * moe.shared_expert(x)
    np.testing.assert_allclose(moe(x), moe.routed(x, w, ids) + shared, rtol=1e-6, atol=1e-6)
    set_moe_routing(moe, "model")
    np.testing.assert_array_equal(moe(x), before)
    with pytest.raises(ValueError, match="^routing"):
        set_moe_routing(moe, "uniform")
