"""Routed MoE experts on a TPU through jax's own grouped matmul, megablox ``gmm``
(``jax.experimental.pallas.ops.tpu.megablox``), not a kernel of this project::

    out[m] = sum_j w[m, j] * down_e( silu(x[m] gate_e) * (x[m] up_e) ),   e = experts[m, j]

The ``M * k`` token-expert pairs are sorted by expert (a stable argsort, XLA) and padded to a
whole number of row tiles; gate, up and down are three ``gmm`` calls over the sorted rows with
the experts' row counts as group sizes (f32 accumulation, each projection rounded to the
weights' dtype as on the XLA path); the weighted rows are scatter-added into their tokens. bf16
or f16 weights only: ``gmm`` runs its dots at the MXU's default precision, which for f32
operands is one bf16 pass.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox import gmm

from pallas_kernels.moe._common import sort_pairs
from pallas_kernels.tpu._common import F32, interpret_params

TILE = 512
WEIGHT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _tile(d: int) -> int:
    """A contraction or output tile for a dimension: the whole dimension up to :data:`TILE`,
    else :data:`TILE` (``gmm`` masks a partial last tile)."""
    return d if d <= TILE else TILE


def check_gmm(x, weights, experts, gate_proj, up_proj, down_proj) -> None:
    """ValueErrors for inputs the ``gmm`` route does not take."""
    if jnp.dtype(gate_proj.dtype) not in WEIGHT_DTYPES:
        raise ValueError(
            f"gate_proj: the TPU gmm route takes bfloat16 or float16 weights, got {gate_proj.dtype}"
        )
    h, i = gate_proj.shape[1], gate_proj.shape[2]
    for name, d in (("H", h), ("I", i)):
        if d > TILE and d % 128:
            raise ValueError(f"{name}: above {TILE} the gmm tiles need a multiple of 128, got {d}")


@functools.partial(jax.jit, static_argnames=("block_m", "interpret"))
def routed_experts_gmm(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    gate_proj: jax.Array,
    up_proj: jax.Array,
    down_proj: jax.Array,
    *,
    block_m: int = 128,
    interpret: bool = False,
) -> jax.Array:
    """``out [M, H]`` in the weights' dtype (module docstring); ``x [M, H]``, ``weights,
    experts [M, k]``, ``gate_proj, up_proj [E, H, I]``, ``down_proj [E, I, H]``. ``block_m``:
    sorted rows per ``gmm`` tile (a multiple of 16)."""
    check_gmm(x, weights, experts, gate_proj, up_proj, down_proj)
    if block_m < 16 or block_m % 16:
        raise ValueError(f"block_m: a multiple of 16, got {block_m}")
    m, k = experts.shape
    e, h, i = gate_proj.shape
    dtype = gate_proj.dtype
    order, sizes, valid = sort_pairs(experts, e)  # ids outside [0, E) last, dropped
    token = order // k
    rows = m * k
    tm = min(block_m, -(-rows // 16) * 16)
    padded = -(-rows // tm) * tm
    xs = jnp.pad(x[token].astype(dtype), ((0, padded - rows), (0, 0)))
    ip = interpret_params(interpret)

    def mm(lhs, rhs, k_dim, n_dim):
        out = gmm(lhs, rhs, sizes, F32, (tm, _tile(k_dim), _tile(n_dim)), interpret=ip)
        return out.astype(dtype)

    hid = jax.nn.silu(mm(xs, gate_proj, h, i).astype(F32)).astype(dtype) * mm(xs, up_proj, h, i)
    y = mm(hid, down_proj, i, h)[:rows]
    y = jnp.where(valid[:, None], y * weights.reshape(-1)[order][:, None].astype(dtype), 0)
    return jnp.zeros((m, h), dtype).at[token].add(y)
