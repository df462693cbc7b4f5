"""The three-kernel chunked prefill (``pallas_kernels.chunk``, interpret mode) against the
gdn_jax XLA chunked path, the XLA token recurrence, float64 numpy and ``chunk/reference.py``,
on random (never zero) inputs; its chunk plan and input checks; and ``chunk/reference.py``
itself against the float64 recurrence.

Shapes are small (interpret mode runs every grid point op by op on the CPU): Hk 2, Hv 4,
K, V in {16, 32}, T <= 150, packed sequences of 1-4 pieces (one empty, one shorter than a chunk).
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
from gdn_jax import chunk_gated_delta_rule, recurrent_gated_delta_rule
from pallas_kernels.chunk.kernel import ChunkBlocks, chunk_plan
from pallas_kernels.chunk.kernel import chunk_gated_delta_rule as chunk_kernel
from pallas_kernels.chunk.reference import chunk_reference
from tests.gdn_jax.reference import recurrent64, rel_err
from tests.gdn_jax.strategies import head_shapes, make_inputs

HK, HV = 2, 4


def _inputs(b, t, dk, dv, n_seq, dtype, seed, heads=(HK, HV), decay="mixed"):
    rng = np.random.default_rng(seed)
    q, k, v, g, beta, _ = make_inputs(rng, b, t, *heads, dk, dv, decay=decay)
    s0 = rng.normal(size=(n_seq, heads[1], dk, dv)).astype(np.float32)
    cast = lambda x: jnp.asarray(x, dtype)
    return cast(q), cast(k), cast(v), jnp.asarray(g), jnp.asarray(beta), jnp.asarray(s0)


def _bounds(b, t, cu):
    """``(row, start, end)`` of every sequence: whole rows, or the pieces of ``cu``."""
    if cu is None:
        return [(r, 0, t) for r in range(b)]
    return [(0, int(a), int(e)) for a, e in zip(cu[:-1], cu[1:], strict=True)]


_ALL_BF16 = ChunkBlocks(store_t=True, u_bf16=True, h_bf16=True)
_FUSE_T = ChunkBlocks(fuse_out=True, store_t=True, block_v_state=16, block_k=16)
_F32, _BF16 = np.float32, jnp.bfloat16
_PACK_4, _PACK_2 = (0, 5, 5, 70, 150), (0, 64, 140)
CASES = [
    # (dtype, l2norm, chunk, B, cu_seqlens or T, K, V, blocks)
    (_F32, True, 16, 1, _PACK_4, 16, 32, ChunkBlocks(block_v_state=16)),
    (_BF16, False, 32, 2, 45, 32, 16, ChunkBlocks(exact_bf16_inputs=False)),
    (_F32, False, 64, 1, (0, 100, 131), 32, 32, ChunkBlocks(block_v_out=16, block_k=16)),
    (_BF16, True, 64, 1, _PACK_2, 16, 16, ChunkBlocks(sub=32, h_bf16=True)),
    # store_t (kernel 1 stores T diag(beta), kernel 2 applies it) and u_bf16
    (_F32, True, 16, 1, _PACK_4, 16, 32, ChunkBlocks(store_t=True)),
    (_BF16, False, 32, 2, 45, 32, 16, ChunkBlocks(store_t=True, block_v_state=16)),
    (_BF16, True, 64, 1, _PACK_2, 16, 16, _ALL_BF16),
    (_F32, False, 64, 1, (0, 100, 131), 32, 32, ChunkBlocks(u_bf16=True, block_v_out=16)),
    # fuse_out (kernel 2 writes the outputs), alone and with store_t
    (_F32, True, 16, 1, _PACK_4, 16, 32, ChunkBlocks(fuse_out=True)),
    (_F32, False, 32, 2, 45, 32, 16, _FUSE_T),
    (_BF16, True, 64, 1, _PACK_2, 16, 16, ChunkBlocks(fuse_out=True, sub=32)),
]


@pytest.mark.parametrize("dtype, l2, chunk, b, seqs, dk, dv, blocks", CASES)
def test_matches_xla(dtype, l2, chunk, b, seqs, dk, dv, blocks):
    """Outputs and final states vs the XLA chunked path (whole call, with ``cu_seqlens``) and
    vs the XLA token recurrence run on each sequence alone, with initial states."""
    packed = isinstance(seqs, tuple)
    t = seqs[-1] if packed else seqs
    cu = np.asarray(seqs, np.int32) if packed else None
    n_seq = len(seqs) - 1 if packed else b
    q, k, v, g, beta, s0 = _inputs(b, t, dk, dv, n_seq, dtype, seed=chunk + t)
    cu_j = None if cu is None else jnp.asarray(cu)
    kw = dict(use_qk_l2norm=l2, chunk_size=chunk, cu_seqlens=cu_j, blocks=blocks)
    o, final = chunk_kernel(q, k, v, g, beta, s0, interpret=True, **kw)
    chex.assert_shape(o, (b, t, HV, dv))
    chex.assert_type((o, final), (dtype, jnp.float32))
    chex.assert_shape(final, s0.shape)
    chex.assert_tree_all_finite((o, final))

    bf16 = dtype == jnp.bfloat16
    # bf16: the output's rounding (and h_bf16's); u_bf16 rounds U, the intra-chunk part of o
    tol_o = 1e-2 if bf16 or blocks.u_bf16 else 2e-5
    tol_s = 1e-4 if bf16 else 2e-5  # bf16 inputs: precision "auto" is bf16x3
    ox, sx = chunk_gated_delta_rule(
        q, k, v, g, beta, s0, use_qk_l2norm=l2, chunk_size=chunk, cu_seqlens=cu, impl="xla"
    )
    assert rel_err(o, ox) < tol_o
    assert rel_err(final, sx) < tol_s

    for s, (r, a, e) in enumerate(_bounds(b, t, cu)):
        if a == e:  # an empty sequence keeps its initial state
            np.testing.assert_array_equal(final[s], s0[s])
            continue
        sl = lambda x, r=r, a=a, e=e: x[r : r + 1, a:e]
        o_r, s_r = recurrent_gated_delta_rule(
            *(sl(x) for x in (q, k, v, g, beta)), s0[s : s + 1], use_qk_l2norm=l2
        )
        assert rel_err(o[r, a:e], o_r[0]) < tol_o
        assert rel_err(final[s], s_r[0]) < tol_s


@pytest.mark.parametrize("cu", [None, (0, 5, 30, 40)])
def test_package_entry_matches_float64_and_xla(cu):
    """``pallas_kernels.chunk_gated_delta_rule`` (chunk 16) vs the float64 recurrence, per
    sequence, with final states, and vs the XLA chunked path."""
    b, t = (2, 20) if cu is None else (1, 40)
    n_seq = b if cu is None else len(cu) - 1
    q, k, v, g, beta, _ = _inputs(b, t, 16, 16, n_seq, np.float32, 5, heads=(1, 2), decay="mild")
    s0 = jnp.asarray(np.random.default_rng(6).normal(size=(n_seq, 2, 16, 16)), jnp.float32)
    cu_j = None if cu is None else jnp.asarray(cu, jnp.int32)
    kw = dict(use_qk_l2norm=True, chunk_size=16, cu_seqlens=cu_j)
    o, final = pk.chunk_gated_delta_rule(q, k, v, g, beta, s0, interpret=True, **kw)
    chex.assert_shape(o, (b, t, 2, 16))
    chex.assert_shape(final, s0.shape)
    for s, (r, a, e) in enumerate(_bounds(b, t, cu)):
        sl = lambda x, r=r, a=a, e=e: np.asarray(x[r : r + 1, a:e])
        piece = (sl(x) for x in (q, k, v, g, beta))
        o64, s64 = recurrent64(*piece, np.asarray(s0[s : s + 1]), use_qk_l2norm=True)
        assert rel_err(o[r, a:e], o64[0]) < 2e-5
        assert rel_err(final[s], s64[0]) < 2e-5
    ox, fx = chunk_gated_delta_rule(q, k, v, g, beta, s0, impl="xla", **kw)
    assert rel_err(o, ox) < 2e-5 and rel_err(final, fx) < 2e-5


def test_traced_cu_seqlens_and_no_state():
    """``cu_seqlens`` traced under jit (one program for any packing), no initial state, and
    ``output_final_state=False``."""
    q, k, v, g, beta, _ = _inputs(1, 40, 16, 16, 1, np.float32, seed=7)
    f = jax.jit(
        lambda cu: chunk_kernel(
            q, k, v, g, beta, use_qk_l2norm=True, chunk_size=16, cu_seqlens=cu, interpret=True
        )
    )
    for cu in ([0, 17, 40], [0, 40, 40]):
        cu = np.asarray(cu, np.int32)
        o, s = f(jnp.asarray(cu))
        ox, sx = chunk_gated_delta_rule(
            q, k, v, g, beta, use_qk_l2norm=True, chunk_size=16, cu_seqlens=cu, impl="xla"
        )
        assert rel_err(o, ox) < 2e-5 and rel_err(s, sx) < 2e-5
    o, s = chunk_kernel(q, k, v, g, beta, chunk_size=16, output_final_state=False, interpret=True)
    assert s is None
    ox, _ = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16, impl="xla")
    assert rel_err(o, ox) < 2e-5


_PACK_T = 40
_CHUNK_STEP = jax.jit(
    lambda q, k, v, g, beta, s0, cu: chunk_kernel(
        q, k, v, g, beta, s0, use_qk_l2norm=True, chunk_size=16, cu_seqlens=cu, interpret=True
    )
)


@settings(max_examples=3, deadline=None)
@given(
    cuts=st.lists(st.integers(0, _PACK_T), min_size=2, max_size=2),
    dtype=st.sampled_from([np.float32, jnp.bfloat16]),
    seed=st.integers(0, 999),
)
def test_matches_reference(cuts, dtype, seed):
    """Three packed sequences at random boundaries (empty and sub-chunk ones included): the
    kernel equals ``chunk/reference.py`` (one compiled program for every packing)."""
    cu = np.array([0, *sorted(cuts), _PACK_T], np.int32)
    q, k, v, g, beta, s0 = _inputs(1, _PACK_T, 16, 16, 3, dtype, seed)
    o, final = _CHUNK_STEP(q, k, v, g, beta, s0, jnp.asarray(cu))
    o_r, final_r = chunk_reference(q, k, v, g, beta, s0, use_qk_l2norm=True, cu_seqlens=cu)
    chex.assert_trees_all_equal_shapes_and_dtypes((o, final), (o_r, final_r))
    tol_o, tol_s = (2e-5, 2e-5) if dtype == np.float32 else (1e-2, 1e-4)
    assert rel_err(o.astype(jnp.float32), o_r.astype(jnp.float32)) < tol_o
    assert rel_err(final, final_r) < tol_s


@settings(max_examples=6, deadline=None)
@given(
    heads=head_shapes(),
    packing=st.sampled_from([None, (0, 3, 3, 11), (0, 11)]),
    l2=st.booleans(),
    scale=st.sampled_from([None, 0.3]),
    with_state=st.booleans(),
    seed=st.integers(0, 999),
)
def test_reference_matches_float64(heads, packing, l2, scale, with_state, seed):
    """``chunk/reference.py`` equals the float64 token recurrence on every sequence (an empty
    one keeps its initial state; no initial state means zeros)."""
    hk, hv, dk, dv = heads
    b, t = (2, 7) if packing is None else (1, packing[-1])
    bounds = _bounds(b, t, packing)
    q, k, v, g, beta, s0 = _inputs(b, t, dk, dv, len(bounds), np.float32, seed, heads=(hk, hv))
    kw = dict(scale=scale, use_qk_l2norm=l2)
    init = s0 if with_state else None
    o, final = chunk_reference(q, k, v, g, beta, init, cu_seqlens=packing, **kw)
    if not with_state:
        s0 = jnp.zeros_like(s0)
    for s, (r, a, e) in enumerate(bounds):
        piece = (np.asarray(x[r : r + 1, a:e]) for x in (q, k, v, g, beta))
        o64, s64 = recurrent64(*piece, np.asarray(s0[s : s + 1]), **kw)
        if a < e:
            assert rel_err(o[r, a:e], o64[0]) < 1e-5
        assert rel_err(final[s], s64[0]) < 1e-5


def test_chunk_plan():
    """Chunk slots never cross a sequence boundary; empty sequences get no chunk."""
    cu = jnp.asarray([0, 5, 5, 70, 150], jnp.int32)
    start, length, first, count = (np.asarray(x) for x in chunk_plan(cu, 16, 150 // 16 + 4))
    np.testing.assert_array_equal(count, [1, 0, 5, 5])
    np.testing.assert_array_equal(first, [0, 1, 1, 6])
    np.testing.assert_array_equal(start[:11], [0, 5, 21, 37, 53, 69, 70, 86, 102, 118, 134])
    np.testing.assert_array_equal(length[:11], [5, 16, 16, 16, 16, 1, 16, 16, 16, 16, 16])
    np.testing.assert_array_equal(length[11:], 0)


def _ones(t=8, hk=1, hv=2, b=1):
    """``q = k [b, t, hk, 16]``, ``v [b, t, hv, 16]`` of ones and ``g = beta [b, t, hv]`` of
    -1 (the input checks raise before any value is read)."""
    x, v = jnp.ones((b, t, hk, 16)), jnp.ones((b, t, hv, 16))
    g = -jnp.ones((b, t, hv))
    return x, x, v, g, g


_K12 = tuple(x[..., :12] if i < 2 else x for i, x in enumerate(_ones()))
_Q_INT = (_ones()[0].astype(jnp.int32), *_ones()[1:])
BAD_INPUTS = [  # (id, message, arguments, keywords)
    ("chunk_size", "chunk_size: .*power of two in \\[16, 64\\]", _ones(), dict(chunk_size=128)),
    ("K", "K: .*power of two", _K12, {}),
    ("Hv", "v: value heads Hv=3 must be a multiple", _ones(hk=2, hv=3), {}),
    ("q-dtype", "q: the chunk kernels accept", _Q_INT, {}),
    ("initial_state", "initial_state: expected shape", (*_ones(), jnp.zeros((2, 2, 16, 16))), {}),
    ("cu-ends", "cu_seqlens: must start at 0 and end at T=8", _ones(), dict(cu_seqlens=[0, 5])),
    ("batch", "cu_seqlens: packed sequences need batch size 1", _ones(b=2), {"cu_seqlens": [0, 8]}),
    ("precision", "blocks.precision", _ones(), dict(blocks=ChunkBlocks(precision="fp8"))),
    ("sub", "blocks.sub", _ones(), dict(blocks=ChunkBlocks(sub=8))),
]


@pytest.mark.parametrize("match, args, kw", [pytest.param(*c[1:], id=c[0]) for c in BAD_INPUTS])
def test_bad_inputs_raise(match, args, kw):
    if "cu_seqlens" in kw:
        kw = {**kw, "cu_seqlens": jnp.asarray(kw["cu_seqlens"])}
    with pytest.raises(ValueError, match=match):
        chunk_kernel(*args, **kw, interpret=True)
