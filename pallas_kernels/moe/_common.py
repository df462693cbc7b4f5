"""Input checks, knob validation and the in-kernel math shared by the MoE kernels.

Shapes: ``x [M, H]``, routing weights ``w [M, k]``, expert ids ``e int [M, k]``,
``gate, up [E, H, I]``, ``down [E, I, H]``; ``n = M * k`` token-expert pairs, pair ``p`` is
``(token p // k, slot p % k)``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels._wy import F32, FLOAT_INPUTS, PRECISIONS, dot_precision


@dataclasses.dataclass(frozen=True)
class TileBlocks:
    """Static knobs common to the Triton MoE kernels.

    ``block_m``: rows (token-expert pairs of one expert) per dot; ``block_i``: columns of the
    ``[*, I]`` gate/up product per program; ``block_h``: columns of the ``[*, H]`` down product
    per program; ``block_kh`` / ``block_ki``: the slice of ``H`` (gate/up) or of ``I`` (down)
    summed per loop step; ``num_warps`` / ``num_stages``: Triton launch knobs (stages pipeline
    the loads of the reduction loop); ``precision``: the dot precision name for float32 expert
    weights (``"tf32x3"``, ``"bf16x3"`` or ``"highest"``; bf16/f16 weights always take one
    exact-product pass with f32 accumulation). Block sizes are powers of two >= 16; a kernel
    uses the largest power of two <= the knob that divides the dimension.
    """

    block_m: int = 16
    block_i: int = 32
    block_h: int = 64
    block_kh: int = 128
    block_ki: int = 128
    num_warps: int = 4
    num_stages: int = 3
    precision: str = "tf32x3"

    def __post_init__(self):
        check_knobs(self, ("block_m", "block_i", "block_h", "block_kh", "block_ki"))


def check_knobs(blocks, block_names: tuple[str, ...]) -> None:
    """``ValueError`` naming the field unless each of ``block_names`` is a power of two >= 16,
    ``num_warps`` one of 1, 2, 4, 8, 16, ``num_stages`` >= 1 and ``precision`` a known name
    (the Triton MoE kernels' knob dataclasses)."""
    for name in block_names:
        v = getattr(blocks, name)
        if not isinstance(v, int) or v < 16 or v & (v - 1):
            raise ValueError(f"{name}: a power of two >= 16, got {v!r}")
    if blocks.num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps: one of 1, 2, 4, 8, 16, got {blocks.num_warps}")
    if blocks.num_stages < 1:
        raise ValueError(f"num_stages: at least 1, got {blocks.num_stages}")
    if blocks.precision not in PRECISIONS:
        raise ValueError(f"precision: one of {tuple(PRECISIONS)}, got {blocks.precision!r}")


def fit_block(name: str, size: int, want: int) -> int:
    """The largest power of two ``<= want`` dividing ``size``; ``ValueError`` if below 16."""
    b = want
    while b >= 16 and size % b:
        b //= 2
    if b < 16:
        raise ValueError(f"{name}: the Pallas MoE kernels need a multiple of 16, got {size}")
    return b


def check_moe_inputs(x, weights, experts, gate, up, down) -> tuple[int, int, int, int, int]:
    """``(M, k, E, H, I)`` of a kernel call; ``ValueError`` naming the argument for a shape or
    dtype the kernels cannot take (``H`` and ``I`` must be multiples of 16)."""
    if x.ndim != 2:
        raise ValueError(f"x: expected [M, H], got shape {x.shape}")
    m, h = x.shape
    if gate.ndim != 3 or gate.shape[1] != h:
        raise ValueError(f"gate: expected [E, H={h}, I], got shape {gate.shape}")
    e, _, i = gate.shape
    if up.shape != gate.shape:
        raise ValueError(f"up: expected gate's shape {gate.shape}, got {up.shape}")
    if down.shape != (e, i, h):
        raise ValueError(f"down: expected [E, I, H] = {(e, i, h)}, got {down.shape}")
    for name, a in (("x", x), ("weights", weights), ("gate", gate)):
        if jnp.dtype(a.dtype) not in FLOAT_INPUTS:
            raise ValueError(
                f"{name}: the Pallas MoE kernels accept float32, bfloat16 or float16, got {a.dtype}"
            )
    for name, a in (("up", up), ("down", down)):
        if a.dtype != gate.dtype:
            raise ValueError(f"{name}: must have gate's dtype {gate.dtype}, got {a.dtype}")
    if experts.ndim != 2 or experts.shape[0] != m:
        raise ValueError(f"experts: expected [M={m}, k], got shape {experts.shape}")
    if not jnp.issubdtype(experts.dtype, jnp.integer):
        raise ValueError(f"experts: expected integer expert ids, got {experts.dtype}")
    if weights.shape != experts.shape:
        raise ValueError(f"weights: expected experts' shape {experts.shape}, got {weights.shape}")
    k = experts.shape[1]
    if m < 1 or k < 1:
        raise ValueError(f"experts: the kernels need M >= 1 and k >= 1, got shape {experts.shape}")
    for name, size in (("H", h), ("I", i)):
        fit_block(name, size, 16)
    return m, k, e, h, i


def weight_precision(dtype, name: str, interpret: bool):
    """The dot precision for expert weights of ``dtype``: ``None`` (one pass, exact products of
    bf16/f16 operands, f32 accumulation) or the named multi-pass one for float32."""
    return dot_precision(name, interpret) if jnp.dtype(dtype) == jnp.float32 else None


def mm(a: jax.Array, b: jax.Array, precision) -> jax.Array:
    """``a @ b`` with f32 accumulation (2-D operands)."""
    return jax.lax.dot_general(
        a, b, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=F32
    )


def swiglu(g: jax.Array, u: jax.Array) -> jax.Array:
    """``silu(g) * u = g / (1 + exp(-g)) * u`` in f32 (written with ``exp``, which the Triton
    lowering has, instead of ``logistic``)."""
    return g / (1.0 + jnp.exp(-g)) * u


def combine(y_pairs: jax.Array, valid: jax.Array, m: int, k: int, dtype) -> jax.Array:
    """``out[m] = sum_j y_pairs[m * k + j]`` over the pairs with ``valid`` expert ids, summed in
    f32 and cast to ``dtype``; ``y_pairs [M * k, H]`` already carries the routing weights."""
    y = y_pairs.reshape(m, k, -1).astype(F32)
    return jnp.sum(jnp.where(valid.reshape(m, k, 1), y, 0.0), axis=1).astype(dtype)


def sort_pairs(experts: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(order, sizes, valid)`` of the ``M * k`` pairs of ``experts [M, k]``: ``order`` sorts
    them by expert (stable, so within an expert in token order), the pairs with ids outside
    ``[0, E)`` last, past every group; ``sizes [E]`` counts each expert's pairs; ``valid`` marks
    the sorted pairs with ids in range."""
    flat = experts.reshape(-1).astype(jnp.int32)
    ok = (flat >= 0) & (flat < num_experts)
    key = jnp.where(ok, flat, num_experts)
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    return order, sizes, ok[order]
