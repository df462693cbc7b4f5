"""The routed-experts kernels (``pallas_kernels.moe``, interpret mode): the small-M and grouped
Triton kernels against ``moe/reference.py``, the XLA path and float64 over random, skewed,
empty-expert, one-token and duplicate-id routings (an expert with more pairs than a block's
rows included); the grouped routing plan; ``reference.py`` against float64; the input and knob
checks; the Mosaic GPU wrapper's CPU guard; and both Triton kernels lowering for sm_90 on this
machine (Triton IR only, nothing compiled)."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pallas_kernels.moe as moe
from gdn_jax.moe import routed_experts
from pallas_kernels.moe.grouped import make_plan, max_blocks
from pallas_kernels.moe.reference import routed_experts_reference
from tests.gdn_jax.test_moe import make_experts, make_routing, rel_err, routed64

E, H, I, K = 5, 32, 16, 3
ROUTINGS = ("random", "skewed", "all_one", "empty", "duplicates")
# tiny tiles: several column tiles per program grid and a 16-row block per expert chunk
SMALL = moe.SmallMBlocks(block_m=16, block_i=16, block_h=16, block_kh=16, block_ki=16, split_k=1)
GROUPED = moe.GroupedBlocks(block_m=16, block_i=16, block_h=16, block_kh=16, block_ki=16, group_m=2)
DECODE = moe.DecodeBlocks(block_i=16, block_k=16, block_h=16, block_hs=16)
KERNELS = {
    "decode": lambda *a: moe.routed_experts_decode(*a, blocks=DECODE, interpret=True),
    "small_m": lambda *a: moe.routed_experts_small_m(*a, blocks=SMALL, interpret=True),
    "grouped": lambda *a: moe.routed_experts_grouped(*a, blocks=GROUPED, interpret=True),
}
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
PLAN = jax.jit(make_plan, static_argnums=(2, 3))
DEFAULT_FNS = {
    "decode": moe.routed_experts_decode,
    "small_m": moe.routed_experts_small_m,
    "grouped": moe.routed_experts_grouped,
}


def inputs(kind, m, seed, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    experts, weights = make_routing(kind, m, K, E, rng)
    x = jnp.asarray(rng.normal(size=(m, H)), dtype)
    return (
        x,
        jnp.asarray(weights, dtype),
        jnp.asarray(experts),
        *make_experts(rng, E, H, I, dtype),
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_kernels_match_reference_and_xla(kernel, kind, dtype):
    """M = 8, k = 3: ``all_one`` puts 24 pairs on one expert (two 16-row chunks / blocks)."""
    args = inputs(kind, 8, 0, dtype)
    out = KERNELS[kernel](*args)
    chex.assert_shape(out, (8, H))
    chex.assert_type(out, dtype)
    ref = routed_experts_reference(*args)
    assert rel_err(out, ref) < TOL[dtype], rel_err(out, ref)
    xla = routed_experts(*args, impl="xla")
    assert rel_err(out, xla) < 2 * TOL[dtype] + (1e-2 if dtype == jnp.bfloat16 else 0)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_one_token_default_blocks(kernel):
    args = inputs("random", 1, 1)
    out = DEFAULT_FNS[kernel](*args, interpret=True)
    assert rel_err(out, routed64(*args)) < 1e-5


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_invalid_ids_contribute_nothing(kernel):
    x, w, experts, g, u, d = inputs("duplicates", 6, 2)
    drop = np.random.default_rng(2).random(experts.shape) < 0.4
    bad = jnp.where(drop, jnp.where(np.arange(K) % 2 == 0, -1, E), experts)
    out = KERNELS[kernel](x, w, bad, g, u, d)
    kept = routed64(x, np.where(drop, 0.0, w), np.where(drop, 0, experts), g, u, d)
    assert rel_err(out, kept) < 1e-5


@settings(max_examples=12, deadline=None)
@given(
    kind=st.sampled_from(ROUTINGS),
    m=st.sampled_from([1, 8]),
    seed=st.integers(0, 2**31 - 1),
    kernel=st.sampled_from(sorted(KERNELS)),
)
def test_random_routings(kind, m, seed, kernel):
    args = inputs(kind, m, seed)
    assert rel_err(KERNELS[kernel](*args), routed64(*args)) < 1e-5


@pytest.mark.parametrize("kind", ["random", "all_one", "duplicates"])
@pytest.mark.parametrize(
    "split_k, target, parts",
    [(2, 256, (2, 2)), (3, 256, (2, 2)), (4, 256, (4, 2)), (0, 40, (4, 2)), (0, 12, (1, 1))],
)
def test_small_m_split_reductions_match_one_program(kind, split_k, target, parts):
    """``SmallMBlocks.split_k``: gate/up split over H (4 loop steps: 2, 2 and 4 parts for
    split_k 2, 3, 4) and down over I (2 steps: 2 parts) give the one-program result to f32
    rounding and float64's; invalid ids (-1, E) still contribute nothing; the kernels' grids
    carry the split axis. ``split_k = 0`` (automatic): 5 experts touched (18 pairs), 2 gate/up
    and 4 down column tiles each, so ``target_programs`` 40 asks 4 and 2 parts, 12 asks one."""
    h, i, m = 64, 32, 6
    rng = np.random.default_rng(split_k + target)
    experts, weights = make_routing(kind, m, K, E, rng)
    drop = rng.random(experts.shape) < 0.25
    experts = np.where(drop, np.where(np.arange(K) % 2 == 0, -1, E), experts)
    x = jnp.asarray(rng.normal(size=(m, h)), jnp.float32)
    args = (x, jnp.asarray(weights), jnp.asarray(experts), *make_experts(rng, E, h, i))
    one = moe.routed_experts_small_m(*args, blocks=SMALL, interpret=True)
    split = moe.SmallMBlocks(
        block_m=16,
        block_i=16,
        block_h=16,
        block_kh=16,
        block_ki=16,
        split_k=split_k,
        target_programs=target,
    )
    got = moe.routed_experts_small_m(*args, blocks=split, interpret=True)
    np.testing.assert_allclose(got, one, rtol=1e-5, atol=1e-6)
    kept = routed64(x, np.where(drop, 0.0, weights), np.where(drop, 0, experts), *args[3:])
    assert rel_err(got, kept) < 1e-5
    jaxpr = jax.make_jaxpr(lambda *a: moe.routed_experts_small_m(*a, blocks=split, interpret=True))(
        *args
    )
    pg, pd = parts  # the largest divisors of 4 and 2 steps not above the asked parts
    assert _pallas_grids(jaxpr.jaxpr) == [
        (32, i // 16) + ((pg,) if pg > 1 else ()),
        (32, h // 16) + ((pd,) if pd > 1 else ()),
    ]


def _pallas_grids(jaxpr) -> list[tuple]:
    """The grids of the pallas_calls in a jaxpr, nested calls included, in order."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            out.append(tuple(eqn.params["grid_mapping"].grid))
        for v in eqn.params.values():
            if hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
                out += _pallas_grids(v.jaxpr)
    return out


def _pallas_names(jaxpr) -> list[str]:
    """The names of the pallas_calls in a jaxpr, nested calls included, in order."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            out.append(eqn.params["jaxpr"].debug_info.func_name)
        for v in eqn.params.values():
            if hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
                out += _pallas_names(v.jaxpr)
    return out


def test_reference_matches_float64():
    for kind in ("random", "all_one", "duplicates"):
        args = inputs(kind, 4, 3)
        assert rel_err(routed_experts_reference(*args), routed64(*args)) < 1e-6


# ------------------------------------------------------------------------------- the plan


@settings(max_examples=20, deadline=None)
@given(
    m=st.sampled_from([1, 5, 12]),
    k=st.sampled_from([1, 3]),
    e=st.sampled_from([4, 9]),
    bm=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_plan_layout(m, k, e, bm, seed):
    """Each valid pair sits in a block of its own expert with its token and weight; blocks hold
    one expert each; the used blocks fit the static bound; padding rows weigh 0."""
    rng = np.random.default_rng(seed)
    skew = rng.random() < 0.5
    experts = rng.integers(0, 2 if skew else e, (m, k))
    experts[rng.random((m, k)) < 0.1] = -1
    weights = rng.uniform(0.1, 1.0, (m, k)).astype(np.float32)
    plan = jax.tree.map(np.asarray, PLAN(jnp.asarray(weights), jnp.asarray(experts), e, bm))
    nb = max_blocks(m * k, e, bm)
    assert plan.block_expert.shape == (nb,) and plan.row_token.shape == (nb * bm,)
    counts = np.bincount(experts[experts >= 0], minlength=e)
    assert (plan.block_expert >= 0).sum() == sum(-(-c // bm) for c in counts)
    flat, w = experts.reshape(-1), weights.reshape(-1)
    rows = plan.pair_row[flat >= 0]
    assert len(set(rows.tolist())) == len(rows)  # distinct rows
    for p in np.flatnonzero(flat >= 0):
        r = plan.pair_row[p]
        assert plan.block_expert[r // bm] == flat[p]
        assert plan.row_token[r] == p // k and plan.row_weight[r] == w[p]
    np.testing.assert_array_equal(plan.valid, flat >= 0)
    pad = np.ones(nb * bm, bool)
    pad[rows] = False
    assert (plan.row_weight[pad] == 0).all()


def test_max_blocks_is_tight():
    """The bound is reached: ``T = min(E, n)`` experts, all but one with a single pair."""
    e, bm = 5, 4
    for n in (1, 3, 5, 6, 9, 23):
        t = min(e, n)
        counts = [n - (t - 1)] + [1] * (t - 1)
        assert sum(-(-c // bm) for c in counts) == max_blocks(n, e, bm)


# ------------------------------------------------------------------------------ the checks


def shared_inputs(m: int, i_s: int, seed: int, dtype=jnp.float32):
    """A shared expert's gated activation ``h_s [m, i_s]`` and down weight ``w_s [H, i_s]``."""
    rng = np.random.default_rng(seed)
    h_s = rng.normal(size=(m, i_s))
    w_s = rng.normal(size=(H, i_s)) / np.sqrt(i_s)
    return jnp.asarray(h_s, dtype), jnp.asarray(w_s, dtype)


@settings(max_examples=10, deadline=None)
@given(
    kind=st.sampled_from(ROUTINGS),
    m=st.integers(1, 3),
    i_s=st.sampled_from([16, 48]),
    seed=st.integers(0, 2**31 - 1),
)
def test_decode_kernel_with_shared_term(kind, m, i_s, seed):
    """The decode kernel's ``shared`` programs (the shared expert's down projection) against
    float64, for a term narrower and wider than the routed experts' ``I``."""
    args = inputs(kind, m, seed)
    h_s, w_s = shared_inputs(m, i_s, seed)
    out = moe.routed_experts_decode(*args, (h_s, w_s), blocks=DECODE, interpret=True)
    ref = routed64(*args) + np.asarray(h_s, np.float64) @ np.asarray(w_s, np.float64).T
    assert rel_err(out, ref) < 1e-5, rel_err(out, ref)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_routed_experts_shared_term(impl):
    """``gdn_jax.routed_experts(..., shared=)``: the decode kernel at one token (``pallas``),
    one matmul after the small-M kernels at four, the XLA path's matmul (``xla``)."""
    for m in (1, 4):
        args = inputs("random", m, 3)
        h_s, w_s = shared_inputs(m, 48, 3)
        out = routed_experts(*args, impl=impl, shared=(h_s, w_s))
        ref = routed64(*args) + np.asarray(h_s, np.float64) @ np.asarray(w_s, np.float64).T
        assert rel_err(out, ref) < 1e-5, (m, rel_err(out, ref))


def glu_inputs(m: int, i_s: int, seed: int, dtype=jnp.float32):
    """A :class:`SharedGLU` over a random ``act [m, C]`` (other columns around the shared
    expert's, as in a fused projection: 8 router columns, gate, up, the logit last) and the
    float64 ``h_s = sigmoid(logit) * silu(gate) * up`` it stands for."""
    rng = np.random.default_rng(seed)
    act = rng.normal(size=(m, 8 + 2 * i_s + 1))
    w_s = rng.normal(size=(H, i_s)) / np.sqrt(i_s)
    act, w_s = jnp.asarray(act, dtype), jnp.asarray(w_s, dtype)
    a = np.asarray(act, np.float64)
    g, u, z = a[:, 8 : 8 + i_s], a[:, 8 + i_s : 8 + 2 * i_s], a[:, -1:]
    h_s = g / (1 + np.exp(-g)) * u / (1 + np.exp(-z))
    glu = moe.SharedGLU(act, w_s, gate_col=8, up_col=8 + i_s, logit_col=8 + 2 * i_s)
    return glu, h_s


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_shared_glu_reads_the_shared_expert_from_its_preactivations(impl, dtype):
    """``shared=SharedGLU(...)``: the decode kernel forms ``sigmoid(logit) * silu(gate) * up``
    from the columns itself (``pallas``, one token: one launch), XLA elsewhere (four tokens,
    ``xla``); both against float64."""
    for m in (1, 4):
        args = inputs("skewed", m, 5, dtype)
        glu, h_s = glu_inputs(m, 32, 5, dtype)
        out = routed_experts(*args, impl=impl, shared=glu)
        ref = routed64(*args) + h_s @ np.asarray(glu.w_s, np.float64).T
        assert out.dtype == dtype and out.shape == (m, H)
        assert rel_err(out, ref) < TOL[dtype], (m, rel_err(out, ref))
    one = inputs("random", 1, 6)
    glu, _ = glu_inputs(1, 32, 6)
    jaxpr = jax.make_jaxpr(lambda *a: routed_experts(*a, impl="pallas", shared=glu))(*one)
    assert _pallas_names(jaxpr.jaxpr) == ["moe_decode"]
    kernel = moe.routed_experts_decode(*one, glu, blocks=DECODE, interpret=True)
    pair = moe.routed_experts_decode(
        *one, (glu.activation(), glu.w_s), blocks=DECODE, interpret=True
    )
    assert rel_err(kernel, np.asarray(pair, np.float64)) < 1e-5


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(gate_col=60), r"^shared: gate_col 60 \+ 32 columns do not fit act's 73"),
        (dict(logit_col=73), r"^shared: logit_col 73 \+ 1 columns"),
        (dict(up_col=-1), r"^shared: up_col -1"),
        (dict(act=np.ones((2, 73))), r"^shared: act must be \[M=1, C\]"),
        (dict(w_s=np.ones((H + 1, 32))), r"^shared: w_s must be \[H=32, I_s\]"),
        (dict(act=np.ones((1, 73), np.int32)), "^shared: act must be floating"),
    ],
)
def test_shared_glu_checks(change, match):
    import dataclasses

    glu = dataclasses.replace(glu_inputs(1, 32, 0)[0], **change)
    with pytest.raises(ValueError, match=match):
        routed_experts(*inputs("random", 1, 0), impl="xla", shared=glu)


def test_pallas_route_takes_the_decode_kernel_at_one_token():
    names = lambda m: _pallas_names(
        jax.make_jaxpr(lambda *a: routed_experts(*a, impl="pallas"))(*inputs("random", m, 0)).jaxpr
    )
    assert names(1) == ["moe_decode"], names(1)
    assert names(2) == ["moe_small_m_gate_up", "moe_small_m_down"], names(2)


@pytest.mark.parametrize(
    "shared, match",
    [
        ("one", "^shared: expected a pair"),
        ((np.ones((2, 16)), np.ones((H, 16))), r"^shared: h_s must be \[M=1"),
        ((np.ones((1, 16)), np.ones((H, 24))), r"^shared: w_s must be \[H=32, I_s=16\]"),
        ((np.ones((1, 16), np.int32), np.ones((H, 16))), "^shared: h_s must be floating"),
    ],
)
def test_shared_term_checks(shared, match):
    args = inputs("random", 1, 0)
    with pytest.raises(ValueError, match=match):
        routed_experts(*args, impl="xla", shared=shared)
    if isinstance(shared, tuple):  # the jitted kernel takes arrays only
        with pytest.raises(ValueError, match=match):
            moe.routed_experts_decode(*args, shared, blocks=DECODE, interpret=True)


def test_decode_pair_limit():
    args = inputs("random", 8, 0)
    with pytest.raises(ValueError, match="^experts: the decode MoE kernel takes at most 16"):
        moe.routed_experts_decode(*args, blocks=moe.DecodeBlocks(max_pairs=16), interpret=True)


def test_small_m_pair_limit():
    args = inputs("random", 8, 0)
    with pytest.raises(ValueError, match="^experts: the small-M MoE kernel takes at most 16"):
        moe.routed_experts_small_m(*args, blocks=moe.SmallMBlocks(max_pairs=16), interpret=True)


@pytest.mark.parametrize(
    "change, name",
    [
        (dict(h=24), "H"),
        (dict(i=8), "I"),
        (dict(x_dtype=jnp.int32), "x"),
        (dict(e_dtype=jnp.float32), "experts"),
    ],
)
def test_kernel_input_checks(change, name):
    rng = np.random.default_rng(0)
    h, i = change.get("h", H), change.get("i", I)
    experts, weights = make_routing("random", 2, K, E, rng)
    x = jnp.ones((2, h), change.get("x_dtype", jnp.float32))
    experts = jnp.asarray(experts, change.get("e_dtype", jnp.int32))
    for fn in DEFAULT_FNS.values():
        with pytest.raises(ValueError, match=f"^{name}:"):
            fn(x, weights, experts, *make_experts(rng, E, h, i), interpret=True)


@pytest.mark.parametrize(
    "cls, kw, name",
    [
        (moe.SmallMBlocks, dict(block_m=24), "block_m"),
        (moe.SmallMBlocks, dict(block_i=8), "block_i"),
        (moe.SmallMBlocks, dict(num_warps=3), "num_warps"),
        (moe.SmallMBlocks, dict(precision="tf32"), "precision"),
        (moe.SmallMBlocks, dict(max_pairs=0), "max_pairs"),
        (moe.SmallMBlocks, dict(split_k=-1), "split_k"),
        (moe.SmallMBlocks, dict(target_programs=0), "target_programs"),
        (moe.GroupedBlocks, dict(block_h=48), "block_h"),
        (moe.DecodeBlocks, dict(block_k=24), "block_k"),
        (moe.DecodeBlocks, dict(block_hs=8), "block_hs"),
        (moe.DecodeBlocks, dict(max_pairs=0), "max_pairs"),
        (moe.DecodeBlocks, dict(num_stages=0), "num_stages"),
        (moe.GroupedBlocks, dict(group_m=0), "group_m"),
        (moe.MgpuBlocks, dict(block_k=48), "block_k"),
    ],
)
def test_knob_checks(cls, kw, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        cls(**kw)


def test_mgpu_guarded_off_gpu():
    """Off a Hopper GPU and off interpret mode the wrapper raises before tracing a kernel."""
    assert not moe.mgpu_available()
    args = inputs("random", 2, 0, jnp.bfloat16)
    fits = moe.MgpuBlocks(block_m=16, block_n=16, block_k=16)
    with pytest.raises(ValueError, match="^impl: the Mosaic GPU grouped matmul needs"):
        moe.routed_experts_mgpu(*args, blocks=fits)
    with pytest.raises(ValueError, match="^gate: ragged_dot_mgpu takes bfloat16 or float16"):
        moe.routed_experts_mgpu(*inputs("random", 2, 0), interpret=True)


@pytest.mark.parametrize("kind, m", [("skewed", 5), ("empty", 3)])
def test_mgpu_interpret_matches_reference(kind, m):
    """jax's Mosaic GPU grouped matmul in Mosaic GPU's interpret mode (TMA copies and wgmma
    simulated on the host), 64-wide tiles over two expert groups and an out-of-range id."""
    rng = np.random.default_rng(7)
    experts, weights = make_routing(kind, m, K, E, rng)
    experts[0, 0] = E  # contributes nothing
    args = (
        jnp.asarray(rng.normal(size=(m, 128)), jnp.bfloat16),
        jnp.asarray(weights, jnp.bfloat16),
        jnp.asarray(experts),
        *make_experts(rng, E, 128, 64, jnp.bfloat16),
    )
    blocks = moe.MgpuBlocks(block_m=64, block_n=64, block_k=64, max_concurrent_steps=2)
    out = moe.routed_experts_mgpu(*args, blocks=blocks, interpret=True)
    chex.assert_shape(out, (m, 128))
    chex.assert_type(out, jnp.bfloat16)
    ref = routed_experts_reference(*args)
    assert rel_err(out, ref) < 2e-2, rel_err(out, ref)


# ------------------------------------------------------------------------- Triton lowering


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("kernel, m", [("small_m", 16), ("grouped", 464)])
def test_lowers_for_sm90(h200, kernel, m, dtype):
    """Qwen3.5-35B-A3B shapes (E 256, k 8, H 2048, I 512), default blocks."""
    s = jax.ShapeDtypeStruct
    args = (
        s((m, 2048), dtype),
        s((m, 8), dtype),
        s((m, 8), jnp.int32),
        s((256, 2048, 512), dtype),
        s((256, 2048, 512), dtype),
        s((256, 512, 2048), dtype),
    )
    fn = moe.routed_experts_small_m if kernel == "small_m" else moe.routed_experts_grouped
    names = [name for name, _ in h200(fn, *args)]
    assert names == [f"moe_{kernel}_gate_up", f"moe_{kernel}_down"], names


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_decode_lowers_for_sm90(h200, dtype):
    """The decode kernel at Qwen3.5-35B-A3B shapes, one token with the shared expert's down
    projection (I_s 512), default blocks: one launch."""
    s = jax.ShapeDtypeStruct
    args = (
        s((1, 2048), dtype),
        s((1, 8), dtype),
        s((1, 8), jnp.int32),
        s((256, 2048, 512), dtype),
        s((256, 2048, 512), dtype),
        s((256, 512, 2048), dtype),
        (s((1, 512), dtype), s((2048, 512), dtype)),
    )
    names = [name for name, _ in h200(moe.routed_experts_decode, *args)]
    assert names == ["moe_decode"], names


def test_small_m_split_lowers_for_sm90(h200):
    """The split-reduction small-M kernels at Qwen3.5-35B-A3B shapes, M 1, bf16: the default
    blocks' automatic split (8 gate/up and 4 down parts) and a fixed one."""
    s = jax.ShapeDtypeStruct
    args = (
        s((1, 2048), jnp.bfloat16),
        s((1, 8), jnp.bfloat16),
        s((1, 8), jnp.int32),
        s((256, 2048, 512), jnp.bfloat16),
        s((256, 2048, 512), jnp.bfloat16),
        s((256, 512, 2048), jnp.bfloat16),
    )
    for blocks in (moe.DEFAULT_SMALL_M_BLOCKS, moe.SmallMBlocks(split_k=2)):
        fn = functools.partial(moe.routed_experts_small_m, blocks=blocks)
        grids = _pallas_grids(jax.make_jaxpr(fn)(*args).jaxpr)
        names = [name for name, _ in h200(fn, *args)]
        assert names == ["moe_small_m_gate_up", "moe_small_m_down"], names
        if blocks.split_k == 0:
            assert grids == [(16, 4, 8), (16, 8, 4)], grids


def test_fused_moe_block_runs_the_decode_kernel_with_its_shared_expert():
    """A model's MoE block with fused projections (as the engine runs it) at one token: the
    decode kernel (interpret mode) takes the routed experts and the shared expert's down
    projection in one launch, and gives the unfused block's output (float32)."""
    from flax import nnx

    from gdn_jax.models import fuse_projections
    from gdn_jax.models.create import init_random
    from tests.gdn_jax.models.test_create import TINY_MOE

    model = init_random(TINY_MOE, jnp.float32, seed=5)
    block = model.layers[0].mlp
    x = jnp.asarray(np.random.default_rng(5).normal(size=(1, TINY_MOE.hidden_size)), jnp.float32)
    want = np.asarray(block(x))
    fused = nnx.merge(*nnx.split(model))
    fuse_projections(fused)
    fblock = fused.layers[0].mlp
    for impl in ("pallas", "xla"):
        fblock.impl = impl
        names = _pallas_names(jax.make_jaxpr(lambda v: fblock(v))(x).jaxpr)
        assert names == (["moe_route_topk", "moe_decode"] if impl == "pallas" else []), names
        assert rel_err(fblock(x), want) < 1e-5, (impl, rel_err(fblock(x), want))
