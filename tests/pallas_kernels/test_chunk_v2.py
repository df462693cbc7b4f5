"""Interpret-mode tests of the three-kernel chunked prefill (``pallas_kernels.chunk.kernel``) against
the gdn_jax XLA chunked path and the XLA token recurrence, on random (never zero) inputs.

Shapes are small (interpret mode runs every grid point op by op on the CPU): Hk 2, Hv 4,
K, V in {16, 32}, T <= 150, packed sequences of 1-4 pieces (one empty, one shorter than a chunk).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn_jax import chunk_gated_delta_rule, recurrent_gated_delta_rule
from pallas_kernels.chunk.kernel import ChunkBlocks, chunk_plan
from pallas_kernels.chunk.kernel import chunk_gated_delta_rule as chunk_v2
from tests.gdn_jax.reference import rel_err
from tests.gdn_jax.strategies import make_inputs

HK, HV = 2, 4


def _inputs(b, t, dk, dv, n_seq, dtype, seed):
    rng = np.random.default_rng(seed)
    q, k, v, g, beta, _ = make_inputs(rng, b, t, HK, HV, dk, dv, decay="mixed")
    s0 = rng.normal(size=(n_seq, HV, dk, dv)).astype(np.float32)
    cast = lambda x: jnp.asarray(x, dtype)
    return cast(q), cast(k), cast(v), jnp.asarray(g), jnp.asarray(beta), jnp.asarray(s0)


_ALL_BF16 = ChunkBlocks(store_t=True, u_bf16=True, h_bf16=True)
_FUSE_T = ChunkBlocks(fuse_out=True, store_t=True, block_v_state=16, block_k=16)
CASES = [
    # (dtype, l2norm, chunk, B, cu_seqlens or T, K, V, blocks)
    (np.float32, True, 16, 1, (0, 5, 5, 70, 150), 16, 32, ChunkBlocks(block_v_state=16)),
    (jnp.bfloat16, False, 32, 2, 45, 32, 16, ChunkBlocks(exact_bf16_inputs=False)),
    (np.float32, False, 64, 1, (0, 100, 131), 32, 32, ChunkBlocks(block_v_out=16, block_k=16)),
    (jnp.bfloat16, True, 64, 1, (0, 64, 140), 16, 16, ChunkBlocks(sub=32, h_bf16=True)),
    # store_t (kernel 1 stores T diag(beta), kernel 2 applies it) and u_bf16
    (np.float32, True, 16, 1, (0, 5, 5, 70, 150), 16, 32, ChunkBlocks(store_t=True)),
    (jnp.bfloat16, False, 32, 2, 45, 32, 16, ChunkBlocks(store_t=True, block_v_state=16)),
    (jnp.bfloat16, True, 64, 1, (0, 64, 140), 16, 16, _ALL_BF16),
    (np.float32, False, 64, 1, (0, 100, 131), 32, 32, ChunkBlocks(u_bf16=True, block_v_out=16)),
    # fuse_out (kernel 2 writes the outputs), alone and with store_t
    (np.float32, True, 16, 1, (0, 5, 5, 70, 150), 16, 32, ChunkBlocks(fuse_out=True)),
    (np.float32, False, 32, 2, 45, 32, 16, _FUSE_T),
    (jnp.bfloat16, True, 64, 1, (0, 64, 140), 16, 16, ChunkBlocks(fuse_out=True, sub=32)),
]


@pytest.mark.parametrize("dtype, l2, chunk, b, seqs, dk, dv, blocks", CASES)
def test_chunk_v2_matches_xla(dtype, l2, chunk, b, seqs, dk, dv, blocks):
    """Outputs and final states vs the XLA chunked path (whole call, with ``cu_seqlens``) and
    vs the XLA token recurrence run on each sequence alone, with initial states."""
    packed = isinstance(seqs, tuple)
    t = seqs[-1] if packed else seqs
    cu = np.asarray(seqs, np.int32) if packed else None
    n_seq = len(seqs) - 1 if packed else b
    q, k, v, g, beta, s0 = _inputs(b, t, dk, dv, n_seq, dtype, seed=chunk + t)
    cu_j = None if cu is None else jnp.asarray(cu)
    o, final = chunk_v2(
        q, k, v, g, beta, s0, use_qk_l2norm=l2, chunk_size=chunk, cu_seqlens=cu_j,
        blocks=blocks, interpret=True,
    )  # fmt: skip
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

    bounds = (
        [(r, 0, t) for r in range(b)]
        if cu is None
        else [(0, a, e) for a, e in zip(cu, cu[1:], strict=False)]
    )
    for s, (r, a, e) in enumerate(bounds):
        if a == e:  # an empty sequence keeps its initial state
            np.testing.assert_array_equal(final[s], s0[s])
            continue
        sl = lambda x, r=r, a=a, e=e: x[r : r + 1, a:e]
        o_r, s_r = recurrent_gated_delta_rule(
            *(sl(x) for x in (q, k, v, g, beta)), s0[s : s + 1], use_qk_l2norm=l2
        )
        assert rel_err(o[r, a:e], o_r[0]) < tol_o
        assert rel_err(final[s], s_r[0]) < tol_s


def test_chunk_v2_traced_cu_seqlens_and_no_state():
    """``cu_seqlens`` traced under jit (one program for any packing), no initial state, and
    ``output_final_state=False``."""
    q, k, v, g, beta, _ = _inputs(1, 40, 16, 16, 1, np.float32, seed=7)
    f = jax.jit(
        lambda cu: chunk_v2(
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
    o, s = chunk_v2(q, k, v, g, beta, chunk_size=16, output_final_state=False, interpret=True)
    assert s is None
    ox, _ = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16, impl="xla")
    assert rel_err(o, ox) < 2e-5


def test_chunk_plan():
    """Chunk slots never cross a sequence boundary; empty sequences get no chunk."""
    cu = jnp.asarray([0, 5, 5, 70, 150], jnp.int32)
    start, length, first, count = (np.asarray(x) for x in chunk_plan(cu, 16, 150 // 16 + 4))
    np.testing.assert_array_equal(count, [1, 0, 5, 5])
    np.testing.assert_array_equal(first, [0, 1, 1, 6])
    np.testing.assert_array_equal(start[:11], [0, 5, 21, 37, 53, 69, 70, 86, 102, 118, 134])
    np.testing.assert_array_equal(length[:11], [5, 16, 16, 16, 16, 1, 16, 16, 16, 16, 16])
    np.testing.assert_array_equal(length[11:], 0)


def test_chunk_v2_bad_inputs_raise():
    x = jnp.ones((1, 8, 1, 16))
    v = jnp.ones((1, 8, 2, 16))
    g = -jnp.ones((1, 8, 2))
    with pytest.raises(ValueError, match="chunk_size: .*power of two in \\[16, 64\\]"):
        chunk_v2(x, x, v, g, g, chunk_size=128, interpret=True)
    with pytest.raises(ValueError, match="K: .*power of two"):
        chunk_v2(x[..., :12], x[..., :12], v, g, g, interpret=True)
    with pytest.raises(ValueError, match="v: value heads Hv=3 must be a multiple"):
        chunk_v2(jnp.ones((1, 8, 2, 16)), jnp.ones((1, 8, 2, 16)), jnp.ones((1, 8, 3, 16)),
                 -jnp.ones((1, 8, 3)), -jnp.ones((1, 8, 3)), interpret=True)  # fmt: skip
    with pytest.raises(ValueError, match="q: the chunk kernels accept"):
        chunk_v2(x.astype(jnp.int32), x, v, g, g, interpret=True)
    with pytest.raises(ValueError, match="initial_state: expected shape"):
        chunk_v2(x, x, v, g, g, jnp.zeros((2, 2, 16, 16)), interpret=True)
    with pytest.raises(ValueError, match="cu_seqlens: must start at 0 and end at T=8"):
        chunk_v2(x, x, v, g, g, cu_seqlens=jnp.asarray([0, 5]), interpret=True)
    with pytest.raises(ValueError, match="cu_seqlens: packed sequences need batch size 1"):
        chunk_v2(*(jnp.concatenate([a, a]) for a in (x, x, v, g, g)),
                 cu_seqlens=jnp.asarray([0, 8]), interpret=True)  # fmt: skip
    with pytest.raises(ValueError, match="blocks.precision"):
        chunk_v2(x, x, v, g, g, blocks=ChunkBlocks(precision="fp8"), interpret=True)
    with pytest.raises(ValueError, match="blocks.sub"):
        chunk_v2(x, x, v, g, g, blocks=ChunkBlocks(sub=8), interpret=True)
