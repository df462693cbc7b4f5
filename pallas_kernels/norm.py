"""The decoder's RMSNorm with its residual add, one kernel: ``(x + d, rmsnorm(x + d) * (1 + w))``.

A decoder layer adds each sub-block's output to the residual stream and normalises the sum
for the next sub-block. XLA runs that as two or three kernels at decode (the residual add, the
mean of squares as a row reduction, the scaling as an elementwise kernel that re-reads the
row); here program ``m`` holds row ``m`` of ``x`` and ``d`` in registers, stores the sum (in
``x``'s dtype, as XLA rounds it) and the normalised row from that rounded sum, in f32:

    s = (x + d) in x.dtype,   y = s * rsqrt(mean(s * s) + eps) * (1 + w)   in x.dtype

Without ``d`` it is the plain norm (one output). A row is read as a power of two of lanes
(masked past ``H``); rows are independent, so any ``M`` runs (one program per row).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._wy import F32, next_pow2

MAX_HIDDEN = 16384  # a row of the widest model held in one program's registers


def check_norm(x, delta, weight) -> tuple[int, int]:
    """``(M, H)`` of ``x [M, H]``; ``ValueError`` for inputs the kernel cannot take."""
    if x.ndim != 2:
        raise ValueError(f"x: expected [M, H], got shape {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x: must be floating point, got {x.dtype}")
    m, h = x.shape
    if not 1 <= h <= MAX_HIDDEN:
        raise ValueError(f"x: the hidden size must be in [1, {MAX_HIDDEN}], got {h}")
    if delta is not None and delta.shape != x.shape:
        raise ValueError(f"delta: expected x's shape {x.shape}, got {delta.shape}")
    if weight.shape != (h,):
        raise ValueError(f"weight: expected shape ({h},), got {weight.shape}")
    return m, h


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def add_rms_norm(x, delta, weight, *, eps: float, interpret: bool = False):
    """``(x + delta, rmsnorm(x + delta) * (1 + weight))`` for ``x, delta: [M, H]``, both in
    ``x``'s dtype (module docstring); ``delta=None``: ``rmsnorm(x) * (1 + weight)`` alone."""
    m, h = check_norm(x, delta, weight)
    hp = next_pow2(h, 16)
    added = delta is not None

    def kernel(*refs):
        if added:
            x_ref, d_ref, w_ref, s_ref, y_ref = refs
        else:
            x_ref, w_ref, y_ref = refs
        row = pl.program_id(0)
        cols = pl.ds(0, hp)
        mask = jax.lax.broadcasted_iota(jnp.int32, (hp,), 0) < h
        s = plt.load(x_ref.at[row, cols], mask=mask, other=0.0)
        if added:
            d = plt.load(d_ref.at[row, cols], mask=mask, other=0.0)
            s = (s.astype(F32) + d.astype(F32)).astype(x.dtype)
            plt.store(s_ref.at[row, cols], s, mask=mask)
        s = s.astype(F32)
        w = plt.load(w_ref.at[cols], mask=mask, other=0.0).astype(F32)
        inv = jax.lax.rsqrt(jnp.sum(s * s) / h + eps)
        plt.store(y_ref.at[row, cols], (s * inv * (1.0 + w)).astype(y_ref.dtype), mask=mask)

    any_spec = pl.BlockSpec(memory_space=None)
    row = jax.ShapeDtypeStruct((m, h), x.dtype)
    out = pl.pallas_call(
        kernel,
        grid=(m,),
        in_specs=[any_spec] * (3 if added else 2),
        out_specs=(any_spec, any_spec) if added else any_spec,
        out_shape=(row, row) if added else row,
        compiler_params=plt.CompilerParams(num_warps=4 if hp <= 4096 else 8, num_stages=1),
        interpret=interpret,
        name="add_rms_norm" if added else "rms_norm",
    )(*((x, delta, weight) if added else (x, weight)))
    return out
