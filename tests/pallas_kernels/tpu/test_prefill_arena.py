"""The TPU chunked prefill on arena states (``pallas_kernels.tpu.chunk_prefill_arena``) in TPU
interpret mode: ragged rows (all ``T`` tokens, a few, none, a fresh row at length 0 with and
without live tokens, a padding row) over one and several chunks, grouped heads stacked or one
per program, against the float64 recurrence and the XLA chunked rule; every arena word outside
the written states untouched; input checks; and the Mosaic lowering at real dims."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from gdn_jax import chunk_gated_delta_rule
from pallas_kernels import tpu
from pallas_kernels.tpu import TpuChunkBlocks, TpuVerifyBlocks
from tests.gdn_jax.reference import recurrent64, rel_err
from tests.gdn_jax.strategies import make_inputs
from tests.pallas_kernels.common import place_states, read_states
from tests.pallas_kernels.tpu.common import F32_TOL, arena_shapes, lowers, shapes

V = 128  # a state row per lane row
SEGMENTS, WORDS, OFFSET = 4, 8192, 256
TABLE = np.array([[3, 128 * 5], [1, 0], [2, 128 * 20], [0, 128 * 3]], np.int32)
SENTINEL = np.uint32(0x7FC0DEAD)  # a NaN: a kernel that read it would poison its row

# (Hk, Hv, K, T, chunk_size, stacked heads per program (0: default), handles, num_tokens or
# None, zero_state or None)
CASES = {
    # two chunks of 16: rows with T, 5 (one live chunk, one read-only), 0 and 13 live tokens;
    # a padding row; fresh rows (stale NaN units) with 13 and with no live tokens
    "ragged": (
        1, 2, 16, 20, 16, 0,
        [2, -1, 0, 3, 1], [20, 5, 0, 13, 0], [False, False, False, True, True],
    ),
    # one short chunk, two key heads of two value heads each, one head per program; defaults
    "grouped": (2, 4, 8, 5, 64, 1, [1, -1, 3], None, None),
}  # fmt: skip


def _run(case, seed):
    hk, hv, dk, t, chunk, heads, handles, nt, zs = CASES[case]
    handles = np.array(handles, np.int32)
    b = handles.size
    nt = np.full(b, t, np.int32) if nt is None else np.array(nt, np.int32)
    zs = np.zeros(b, bool) if zs is None else np.array(zs, bool)
    rng = np.random.default_rng(seed)
    q, k, v, g, beta, s0 = make_inputs(rng, b, t, hk, hv, dk, V, decay="mixed")
    arena = np.full((SEGMENTS, WORDS), SENTINEL, np.uint32)
    place_states(arena, TABLE, handles, s0, OFFSET, skip=zs)
    blocks = TpuChunkBlocks(TpuVerifyBlocks(heads=heads))
    o, out = tpu.chunk_prefill_arena(
        *(jnp.asarray(x) for x in (q, k, v, g, beta, arena, TABLE, handles)),
        state_offset=OFFSET,
        num_tokens=None if case == "grouped" else jnp.asarray(nt),
        use_qk_l2norm=True,
        zero_state=None if case == "grouped" else jnp.asarray(zs),
        chunk_size=chunk,
        blocks=blocks,
        interpret=True,
    )
    # what the kernel should compute: zero states for padding and fresh rows, tokens past
    # num_tokens with g = beta = 0
    dense = s0.copy()
    dense[(handles < 0) | zs] = 0.0
    live = (np.arange(t)[None, :] < nt[:, None])[..., None]
    gm, bm = (np.where(live, x, 0.0).astype(np.float32) for x in (g, beta))
    return (q, k, v, gm, bm, dense), (handles, arena, hv, dk), (np.asarray(o), np.asarray(out))


@pytest.mark.parametrize("case", list(CASES))
def test_matches_float64_and_xla(case):
    (q, k, v, gm, bm, dense), (handles, arena, hv, dk), (o, out) = _run(case, seed=len(case))
    o64, s64 = recurrent64(q, k, v, gm, bm, dense, use_qk_l2norm=True)
    ox, sx = chunk_gated_delta_rule(
        *(jnp.asarray(x) for x in (q, k, v, gm, bm, dense)), use_qk_l2norm=True, impl="xla"
    )
    assert o.shape == v.shape and o.dtype == np.float32 and np.isfinite(o).all()
    assert rel_err(o, o64) < F32_TOL and rel_err(o, ox) < F32_TOL
    states, other = read_states(out, TABLE, handles, OFFSET, (hv, dk, V))
    for r, s in enumerate(states):
        if s is None:  # padding: its output ran from zeros, its (absent) unit is not written
            continue
        if not np.any(s64[r]):  # a fresh row with no live token: written as zeros
            np.testing.assert_array_equal(s, 0.0)
            continue
        assert rel_err(s, s64[r]) < F32_TOL and rel_err(s, sx[r]) < F32_TOL, r
    # every other word (other layers' and fields' words, free units) is untouched
    np.testing.assert_array_equal(out[other], arena[other])
    assert (out[other] == SENTINEL).all()


def test_bad_inputs():
    rng = np.random.default_rng(1)
    q, k, v, g, beta, _ = (jnp.asarray(x) for x in make_inputs(rng, 2, 4, 1, 2, 16, V))
    ops = (jnp.zeros((SEGMENTS, WORDS), jnp.uint32), jnp.asarray(TABLE), jnp.array([0, 1]))
    with pytest.raises(ValueError, match="chunk_size"):
        tpu.chunk_prefill_arena(q, k, v, g, beta, *ops, state_offset=OFFSET, chunk_size=48)
    with pytest.raises(ValueError, match="state_offset"):
        tpu.chunk_prefill_arena(q, k, v, g, beta, *ops, state_offset=100)
    with pytest.raises(ValueError, match="num_tokens"):
        tpu.chunk_prefill_arena(
            q, k, v, g, beta, *ops, state_offset=OFFSET, num_tokens=jnp.array([1, 2, 3])
        )
    with pytest.raises(ValueError, match="V"):
        tpu.chunk_prefill_arena(q, k, v[..., :64], g, beta, *ops, state_offset=OFFSET)


def test_lowers():
    b, t, hk, hv, d = 4, 100, 2, 4, 128
    bf, f, i32 = jnp.bfloat16, jnp.float32, jnp.int32
    args = shapes(
        ((b, t, hk, d), bf), ((b, t, hk, d), bf), ((b, t, hv, d), bf), ((b, t, hv), f),
        ((b, t, hv), f),
    )  # fmt: skip

    def fn(q, k, v, g, beta, arena, table, handles, nt, zs):
        return tpu.chunk_prefill_arena(
            q, k, v, g, beta, arena, table, handles, state_offset=128, num_tokens=nt,
            use_qk_l2norm=True, zero_state=zs,
        )  # fmt: skip

    assert lowers(fn, *args, *arena_shapes(b), *shapes(((b,), i32), ((b,), jnp.bool_)))
