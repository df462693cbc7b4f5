"""The in-place decode conv (``pallas_kernels.decode.conv.conv_step``, interpret mode): one
token's depthwise causal conv with SiLU on the conv states held in a uint32 arena equals
``gdn_jax.causal_conv1d`` on the same states read out, and writes the shifted window back in
place (bfloat16 two to a word, or float32); padding rows are never written, fresh rows start
from a zero state, rows whose token is padding keep their state, and no other word changes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn_jax import causal_conv1d
from pallas_kernels.decode.conv import conv_step
from serving.memory.arena import field_to_words, words_to_field
from tests.pallas_kernels.common import SEGMENTS, TABLE, WORDS

OFFSET = 37  # odd: rows of the window start mid-segment at any word
HANDLES = np.array([2, -1, 0, 4, 1], np.int32)  # valid, padding, fresh, not live, valid
FRESH = np.array([False, False, True, False, False])
LIVE = np.array([True, True, True, False, True])


def _place(arena, states, dtype):
    """Each valid row's state ``[W-1, C]`` as words at its handle's place."""
    arena = arena.copy()
    for row, h in enumerate(HANDLES):
        if h >= 0 and not FRESH[row]:
            words = np.asarray(field_to_words(jnp.asarray(states[row], dtype)))
            seg, word = TABLE[h]
            arena[seg, word + OFFSET : word + OFFSET + words.size] = words
    return arena


def _read(arena, shape, dtype):
    """Each valid row's state in ``arena`` and a mask of every other word."""
    n = np.asarray(field_to_words(jnp.zeros(shape, dtype))).size
    other = np.ones(arena.shape, bool)
    got = []
    for h in HANDLES:
        if h < 0:
            got.append(None)
            continue
        seg, word = TABLE[h]
        other[seg, word + OFFSET : word + OFFSET + n] = False
        span = jnp.asarray(arena[seg, word + OFFSET : word + OFFSET + n])
        got.append(np.asarray(words_to_field(span, shape, dtype), np.float32))
    return got, other


@pytest.mark.parametrize(
    "dtype, c, w, block_c", [(jnp.bfloat16, 64, 4, 16), (jnp.float32, 48, 3, 16)]
)
def test_conv_step_matches_causal_conv(dtype, c, w, block_c):
    rng = np.random.default_rng(c + w)
    b = len(HANDLES)
    x = jnp.asarray(rng.standard_normal((b, c)), dtype)
    weight = jnp.asarray(rng.standard_normal((c, w)) * 0.5, dtype)
    states = jnp.asarray(rng.standard_normal((b, w - 1, c)), dtype)
    arena0 = rng.integers(0, 2**32, (SEGMENTS, WORDS), dtype=np.uint32)  # garbage, NaNs too
    arena0 = _place(arena0, states, dtype)
    fn = jax.jit(
        functools.partial(
            conv_step, conv_offset=OFFSET, state_dtype=dtype, block_c=block_c, interpret=True
        ),
        donate_argnums=2,
    )
    y, new = fn(
        x, weight, jnp.asarray(arena0), jnp.asarray(TABLE), jnp.asarray(HANDLES),
        zero_state=jnp.asarray(FRESH), live=jnp.asarray(LIVE),
    )  # fmt: skip
    assert y.dtype == x.dtype and y.shape == (b, c)
    start = jnp.where(jnp.asarray(FRESH | (HANDLES < 0))[:, None, None], 0, states)
    y_ref, s_ref = causal_conv1d(x[:, None], weight, start)
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    for row in range(b):
        if LIVE[row]:
            np.testing.assert_allclose(
                np.asarray(y[row], np.float32), np.asarray(y_ref[row, 0], np.float32),
                rtol=tol, atol=tol,
            )  # fmt: skip
    got, other = _read(np.asarray(new), (w - 1, c), dtype)
    for row, s in enumerate(got):
        if s is None:
            continue
        want = s_ref[row] if LIVE[row] else states[row]
        np.testing.assert_array_equal(s, np.asarray(want, np.float32))  # exact: values moved
    np.testing.assert_array_equal(np.asarray(new)[other], arena0[other])


def test_conv_step_reads_columns_in_place():
    """The channels read at ``x_col`` of a wider array (a fused projection's output) give the
    kernel on the sliced channels bit for bit, outputs and arena."""
    rng = np.random.default_rng(5)
    b, c, w = len(HANDLES), 64, 4
    wide = jnp.asarray(rng.standard_normal((b, 3 + c + 5)), jnp.bfloat16)
    weight = jnp.asarray(rng.standard_normal((c, w)) * 0.5, jnp.bfloat16)
    arena0 = _place(
        rng.integers(0, 2**32, (SEGMENTS, WORDS), dtype=np.uint32),
        jnp.asarray(rng.standard_normal((b, w - 1, c)), jnp.bfloat16),
        jnp.bfloat16,
    )
    call = functools.partial(
        conv_step, conv_offset=OFFSET, state_dtype=jnp.bfloat16, block_c=16, interpret=True
    )
    addr = (jnp.asarray(TABLE), jnp.asarray(HANDLES))
    y1, new1 = call(wide[:, 3 : 3 + c], weight, jnp.asarray(arena0), *addr)
    y2, new2 = call(wide, weight, jnp.asarray(arena0), *addr, x_col=3)
    np.testing.assert_array_equal(np.asarray(y2, np.float32), np.asarray(y1, np.float32))
    np.testing.assert_array_equal(np.asarray(new2), np.asarray(new1))
    with pytest.raises(ValueError, match="^x_col"):
        call(wide, weight, jnp.asarray(arena0), *addr, x_col=9)


@pytest.mark.parametrize(
    "name, kw",
    [
        ("state_dtype", dict(state_dtype=jnp.float16)),
        ("x", dict(x=jnp.zeros((5, 64), jnp.float32))),
        ("x", dict(x=jnp.zeros((5, 1, 64), jnp.bfloat16))),
        ("weight", dict(weight=jnp.zeros((32, 1), jnp.bfloat16))),
        ("x_col", dict(weight=jnp.zeros((128, 4), jnp.bfloat16))),
        ("block_c", dict(block_c=24)),
        ("conv_offset", dict(conv_offset=WORDS)),
        ("handles", dict(handles=jnp.zeros((2,), jnp.int32))),
        ("live", dict(live=jnp.ones((2,), bool))),
        ("zero_state", dict(zero_state=jnp.ones((3,), bool))),
    ],
)
def test_conv_step_bad_inputs_raise(name, kw):
    args = dict(
        x=jnp.zeros((5, 64), jnp.bfloat16),
        weight=jnp.zeros((64, 4), jnp.bfloat16),
        arena=jnp.zeros((SEGMENTS, WORDS), jnp.uint32),
        table=jnp.asarray(TABLE),
        handles=jnp.asarray(HANDLES),
    )
    opts = dict(conv_offset=OFFSET, state_dtype=jnp.bfloat16, interpret=True)
    args.update({k: v for k, v in kw.items() if k in args})
    opts.update({k: v for k, v in kw.items() if k not in args})
    with pytest.raises(ValueError, match=f"^{name}"):
        conv_step(*args.values(), **opts)
