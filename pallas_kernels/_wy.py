"""In-kernel math shared by the WY kernels (tree verify, chunk prefill) and the input checks.

The helpers below act on values already loaded from refs; every array is 2-D or 1-D with
power-of-two sides (the Triton lowering's rule), and every dot is a plain 2-D matmul.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

L2NORM_EPS = 1e-6
F32 = jnp.float32
PRECISIONS = {
    "highest": jax.lax.Precision.HIGHEST,
    "tf32x3": jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
    "bf16x3": jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3,
}
FLOAT_INPUTS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class DotBlocks:
    """Static knobs of the WY kernels: value columns per program, Triton warps/stages, dot
    precision name.

    ``precision``: ``"tf32x3"`` (three tf32 passes on the tensor cores, f32-level accuracy; CPU
    has no tf32, so interpret mode runs it as ``"highest"``), ``"highest"`` (IEEE f32 FMAs, slow
    in Triton) or ``"bf16x3"`` (two bf16 halves per operand, 3 MMAs, f32 accumulation).
    """

    block_v: int = 64
    num_warps: int = 4
    num_stages: int = 1
    precision: str = "tf32x3"


DEFAULT_BLOCKS = DotBlocks()


def dot_precision(name: str, interpret: bool):
    """The ``dot_general`` precision for a ``*Blocks.precision`` name (CPU lacks tf32x3)."""
    if name not in PRECISIONS:
        raise ValueError(f"blocks.precision: one of {tuple(PRECISIONS)}, got {name!r}")
    if interpret and name == "tf32x3":
        return PRECISIONS["highest"]
    return PRECISIONS[name]


def next_pow2(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(n - 1, 0).bit_length())


def check_pow2_dim(name: str, size: int, lo: int = 16, hi: int = 256) -> None:
    if size < lo or size > hi or size & (size - 1):
        raise ValueError(
            f"{name}: the Pallas kernels need a power of two in [{lo}, {hi}], got {size}"
        )


def check_float(name: str, x: jax.Array, kernels: str = "Pallas") -> None:
    """ValueError unless ``x`` is float32, bfloat16 or float16 (``kernels`` names the family in
    the message: ``"Pallas"``, ``"TPU"``)."""
    if jnp.dtype(x.dtype) not in FLOAT_INPUTS:
        raise ValueError(
            f"{name}: the {kernels} kernels accept float32, bfloat16 or float16, got {x.dtype}"
        )


def check_grouped_heads(hk: int, hv: int, name: str = "v") -> None:
    """ValueError unless the ``hv`` value heads of operand ``name`` group evenly over the ``hk``
    key heads."""
    if hv % hk:
        raise ValueError(f"{name}: value heads Hv={hv} must be a multiple of key heads Hk={hk}")


def check_max_nodes(n: int, limit: int, kernel: str) -> None:
    """ValueError for a tree of more than ``limit`` nodes (``kernel`` names it in the message)."""
    if n > limit:
        raise ValueError(f"N: the {kernel} supports at most {limit} nodes, got {n}")


def check_blocks(blocks, cls: type) -> None:
    """ValueError unless the ``blocks=`` knobs are a ``cls`` instance."""
    if not isinstance(blocks, cls):
        raise ValueError(f"blocks: a {cls.__name__}, got {type(blocks).__name__}")


def default_scale(scale: float | None, dk: int) -> float:
    """The query scale: ``K ** -0.5`` unless given."""
    return dk**-0.5 if scale is None else float(scale)


def pad_axis(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
    """Pads ``axis`` of ``x`` up to ``size`` with ``value`` (no copy when already that size)."""
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def mask_path(path: jax.Array, path_len: jax.Array, size: int) -> jax.Array:
    """int32 accepted paths ``[B, size]``: ``path [B, D]`` with the entries past ``path_len[b]``
    set to -1, padded with -1 up to ``size`` columns."""
    valid = jnp.arange(path.shape[1])[None, :] < path_len[:, None]
    return pad_axis(jnp.where(valid, path, -1).astype(jnp.int32), 1, size, value=-1)


def dot(a: jax.Array, b: jax.Array, precision, *, trans_a: bool = False, trans_b: bool = False):
    """``a @ b`` (optionally transposed operands) with f32 accumulation."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=F32)


def l2norm_rows(x: jax.Array) -> jax.Array:
    """``x * rsqrt(sum(x * x, -1) + 1e-6)`` row-wise, in f32 (docs/design.md)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def prep_rows(x: jax.Array, use_l2norm: bool, scale: float | None = None) -> jax.Array:
    x = x.astype(F32)
    if use_l2norm:
        x = l2norm_rows(x)
    return x if scale is None else x * scale


def ancestor_closure(parents: jax.Array) -> jax.Array:
    """bool ``[N, N]`` inclusive ancestor mask ``P`` from int32 parent ids ``[N]``.

    Repeated squaring of ``I + onehot(parent)`` in bf16 dots with f32 accumulation: the entries
    are 0/1 and the sums path counts <= N, so every step is exact in one tensor-core pass.
    """
    n = parents.shape[0]
    row = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)
    reach = ((parents[:, None] == col) | (row == col)).astype(jnp.bfloat16)
    for _ in range(max(n - 1, 1).bit_length()):
        prod = jax.lax.dot_general(
            reach, reach, (((1,), (0,)), ((), ())), preferred_element_type=F32
        )
        reach = jnp.minimum(prod, 1.0).astype(jnp.bfloat16)
    return reach > 0.5


def masked_decay(gi: jax.Array, gj: jax.Array, mask: jax.Array) -> jax.Array:
    """``where(mask, exp(gi - gj), 0)`` with the difference masked before ``exp``."""
    return jnp.where(mask, jnp.exp(jnp.where(mask, gi - gj, 0.0)), 0.0)


def unit_lower_inverse(a: jax.Array, precision) -> jax.Array:
    """``(I + A)^-1`` for strictly lower-triangular ``A [N, N]`` by product doubling.

    ``(I + A)^-1 = (I - A)(I + A^2)(I + A^4)...``: exact since ``A^N = 0``; ``2 ceil(log2 N) - 1``
    matmuls, all on the tensor cores when the precision allows.
    """
    n = a.shape[0]
    row = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)
    t = jnp.where(row == col, 1.0, 0.0) - a
    p = a
    for _ in range(max(n - 1, 1).bit_length() - 1):
        p = dot(p, p, precision)
        t = t + dot(t, p, precision)
    return t


def wy_block(q, k, v, beta, g_path, decay, strict, s0, precision):
    """One WY block: ``U = (I + A)^-1 diag(beta) (V - diag(e^G) K S0)`` and
    ``O = diag(e^G) Q S0 + ((Q K^T) * D) U`` (docs/design.md). All f32; returns ``(o, u)``.
    """
    kk = dot(k, k, precision, trans_b=True)
    a = beta[:, None] * jnp.where(strict, decay, 0.0) * kk
    eg = jnp.exp(g_path)[:, None]
    rhs = beta[:, None] * (v - eg * dot(k, s0, precision))
    u = dot(unit_lower_inverse(a, precision), rhs, precision)
    att = dot(q, k, precision, trans_b=True) * decay
    o = eg * dot(q, s0, precision) + dot(att, u, precision)
    return o, u


class TreeLaunch(NamedTuple):
    """Padded tree inputs and the launch facts both tree kernels' wrappers need."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    g: jax.Array
    beta: jax.Array
    parents: jax.Array
    npad: int
    bv: int
    grp: int
    scale: float


def check_heads_dims(q, k, v, *, hk: int, dk: int, hv: int, dv: int) -> None:
    """ValueErrors for grouped heads that do not divide, non-power-of-two K / V and non-float
    q / k / v."""
    check_grouped_heads(hk, hv)
    check_pow2_dim("K", dk)
    check_pow2_dim("V", dv)
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_float(name, x)


def prepare_tree_launch(q, k, v, g, beta, parents, *, scale, block_v: int) -> TreeLaunch:
    """Checks a tree kernel's inputs (ValueError naming the limit) and pads ``N`` to a power of
    two >= 16 with padding nodes (parent -2, zero inputs)."""
    hk, dk = k.shape[2], k.shape[3]
    hv, dv = v.shape[2], v.shape[3]
    check_heads_dims(q, k, v, hk=hk, dk=dk, hv=hv, dv=dv)
    npad = next_pow2(k.shape[1], 16)
    q, k, v, g, beta = (pad_axis(x, 1, npad) for x in (q, k, v, g, beta))
    parents = pad_axis(parents.astype(jnp.int32), 1, npad, value=-2)
    scale = default_scale(scale, dk)
    return TreeLaunch(
        q, k, v, g, beta, parents, npad=npad, bv=min(block_v, dv), grp=hv // hk, scale=scale
    )
