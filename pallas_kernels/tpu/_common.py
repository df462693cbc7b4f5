"""Pieces shared by the Mosaic TPU kernels: interpret parameters, dots with explicit bf16
splits, row / column conversions and the Newton-Schulz inverse, layout helpers, input checks,
VMEM budgets, and the Mosaic lowering of a function without a TPU (:func:`lower_for_tpu`).
What the TPU and GPU kernels share on the host and in the math (padding, masked decays, dtype
and head checks, path masks) is in :mod:`pallas_kernels._wy`.

**Dots.** The MXU multiplies bf16 operands exactly and accumulates in f32. Every dot of the TPU
kernels that has an f32 operand splits it into bf16 pieces itself (:func:`dot`), so the
numerics are the same in TPU interpret mode on a CPU as on a TPU: ``"bf16"`` rounds f32
operands to bf16 (one pass), ``"bf16x3"`` splits each f32 operand into a high and a low bf16
half and sums three products (``hi hi + hi lo + lo hi``, about 2^-16 relative), ``"bf16x6"``
splits into three pieces and sums the six products above the ``2^-24`` level (f32 level).
A bf16 operand enters unsplit (its products are exact), so a bf16 x f32 dot costs 1, 2 or 3
passes at those names.

**Layouts.** Blocks keep their last dimension on the 128 lanes: the kernels read head-major
``[B, H, N, D]`` activations (a ``[N, D]`` block per head, ``D`` on the lanes) and ``[B, Hv,
K, V]`` states; per-node scalars (``g``, ``beta``, path decays) travel as rows ``[..., 1, N]``
(nodes on the lanes) or columns ``[..., N, 1]``, whichever the kernel consumes, and
:func:`to_col` / :func:`to_row` convert in-kernel (a diagonal select and a sum, exact).

**VMEM.** :func:`vmem_bytes` is the budget of one kernel: each pipelined block twice (double
buffering), scratch once, plus the kernel's own estimate of its live temporaries, every array
padded to whole ``(8 * packing, 128)`` tiles. :func:`compiler_params` passes it to Mosaic as
``vmem_limit_bytes`` (at least the 16 MiB default scope) and refuses a kernel above
:data:`VMEM_CAP` (the 64 MiB of the smallest TPU VMEM, v7x) with ``ValueError``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._wy import F32, L2NORM_EPS, check_float, check_grouped_heads

BF16 = jnp.bfloat16
LANES = 128
SUBLANES = 8
MIB = 1 << 20
VMEM_CAP = 64 * MIB
VMEM_DEFAULT = 16 * MIB
PASSES = {"bf16": 1, "bf16x3": 3, "bf16x6": 6}
PIECES = {"bf16": 1, "bf16x3": 2, "bf16x6": 3}


def interpret_params(interpret: bool):
    """``pallas_call``'s ``interpret`` argument: TPU interpret mode or compiled Mosaic."""
    return pltpu.InterpretParams() if interpret else False


def check_precision(name: str, value: str) -> None:
    if value not in PASSES:
        raise ValueError(f"{name}: one of {tuple(PASSES)}, got {value!r}")


# ------------------------------------------------------------------------------------ dots


def split(x: jax.Array, precision: str) -> list[jax.Array]:
    """``x`` as the bf16 pieces a dot at ``precision`` uses (1, 2 or 3 pieces whose f32 sum
    approximates ``x``); a bf16 ``x`` is one exact piece. Split an operand once when several
    dots read it."""
    if x.dtype == BF16:
        return [x]
    x = x.astype(F32)
    out = [x.astype(BF16)]
    for _ in range(PIECES[precision] - 1):
        x = x - out[-1].astype(F32)
        out.append(x.astype(BF16))
    return out


def _pairs(na: int, nb: int, precision: str) -> list[tuple[int, int]]:
    """Piece pairs ``(i, j)`` summed by a dot at ``precision``: all pairs above the dropped
    ``2^-16`` (bf16x3) or ``2^-24`` (bf16x6) level, or every pair when one side is exact."""
    if na == 1 or nb == 1:
        return [(i, j) for i in range(na) for j in range(nb)]
    keep = PIECES[precision] - 1
    return [(i, j) for i in range(na) for j in range(nb) if i + j <= keep]


def dot(a, b, precision: str, *, trans_a=False, trans_b=False, mxu: int = LANES):
    """``a @ b`` (2-D, optionally transposed operands) with f32 accumulation. ``a`` and ``b``
    are arrays or lists of pieces from :func:`split`; f32 arrays are split at ``precision``
    (module docstring), bf16 arrays enter as they are.

    ``mxu``: the MXU's width. The MXU pads ``b``'s columns to whole multiples of it, so where
    ``n`` is a multiple of 128 below that width (``n = 128`` on a 256-wide MXU) the pieces of
    ``b`` that meet one piece of ``a`` enter one dot side by side, ``a_i [b_j | b_j']``, and its
    column blocks are summed: one MXU pass instead of two, the same products summed in the same
    order."""
    sa = a if isinstance(a, list) else split(a, precision)
    sb = b if isinstance(b, list) else split(b, precision)
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    n = sb[0].shape[1]
    fit = 1 if trans_b or n % LANES else max(1, -(-n // mxu) * mxu // n)
    out = None
    pairs = _pairs(len(sa), len(sb), precision)
    for i in sorted({i for i, _ in pairs}):
        js = [j for ii, j in pairs if ii == i]
        for c in range(0, len(js), fit):
            group = js[c : c + fit]
            rhs = sb[group[0]] if len(group) == 1 else jnp.concatenate([sb[j] for j in group], 1)
            p = jax.lax.dot_general(sa[i], rhs, dims, preferred_element_type=F32)
            for g in range(len(group)):
                part = p if len(group) == 1 else p[:, g * n : (g + 1) * n]
                out = part if out is None else out + part
    return out


# ---------------------------------------------------------------------- rows, columns, masks


def iota(shape, axis: int) -> jax.Array:
    return jax.lax.broadcasted_iota(jnp.int32, shape, axis)


def eye_mask(n: int) -> jax.Array:
    return iota((n, n), 0) == iota((n, n), 1)


def to_col(row: jax.Array) -> jax.Array:
    """``(1, n)`` -> ``(n, 1)``: a diagonal select and a lane sum (exact)."""
    n = row.shape[1]
    zero = jnp.zeros((), row.dtype)
    return jnp.sum(jnp.where(eye_mask(n), row, zero), axis=1, keepdims=True)


def to_row(col: jax.Array) -> jax.Array:
    """``(n, 1)`` -> ``(1, n)``: a diagonal select and a sublane sum (exact)."""
    n = col.shape[0]
    zero = jnp.zeros((), col.dtype)
    return jnp.sum(jnp.where(eye_mask(n), col, zero), axis=0, keepdims=True)


def row_scales(x: jax.Array, use_l2norm: bool, scale: float | None = None) -> jax.Array:
    """f32 ``(n, 1)`` scales ``rsqrt(|x_r|^2 + eps) * scale`` that l2-normalise the rows of
    ``x`` (ones, or ``scale``, without the l2norm)."""
    n = x.shape[0]
    s = jnp.full((n, 1), 1.0 if scale is None else scale, F32)
    if not use_l2norm:
        return s
    xf = x.astype(F32)
    return s * jax.lax.rsqrt(jnp.sum(xf * xf, axis=1, keepdims=True) + L2NORM_EPS)


def newton_inverse(a: jax.Array, steps: int, precision: str) -> jax.Array:
    """``X ~ (I + A)^-1`` for strictly lower-triangular ``A (m, m)`` by Newton-Schulz:
    ``X <- X + X (I - (I + A) X)`` from ``X = I - A``; the residual ``(-A)^(2^j)`` is nilpotent,
    so ``steps = ceil(log2 depth) - 1`` steps give the exact inverse, and rounding errors of one
    step are squared away by the next."""
    m = a.shape[0]
    eye = jnp.where(eye_mask(m), 1.0, 0.0).astype(F32)
    x = eye - a
    sa = split(a, precision)
    for _ in range(steps):
        r = eye - x - dot(sa, x, precision)
        x = x + dot(x, r, precision)
    return x


def newton_steps(depth: int) -> int:
    """Newton-Schulz steps after ``X = I - A`` for trees of at most ``depth`` nodes deep."""
    return max(max(depth - 1, 1).bit_length() - 1, 0)


# ----------------------------------------------------------------------------- layouts, VMEM


def gbeta_pairs(g: jax.Array, beta: jax.Array) -> jax.Array:
    """f32 ``(g, beta)`` pairs on a new last axis: ``[..., H]`` -> ``[..., H, 2]``."""
    return jnp.stack([g.astype(F32), beta.astype(F32)], axis=-1)


def head_major(x: jax.Array) -> jax.Array:
    """``[B, N, H, D]`` -> ``[B, H, N, D]`` (``[B, N, H]`` -> ``[B, H, N]``)."""
    return jnp.swapaxes(x, 1, 2)


def tile_bytes(shape: Sequence[int], dtype) -> int:
    """Bytes of an array in VMEM: the last two dims padded to ``(8 * packing, 128)`` tiles."""
    itemsize = jnp.dtype(dtype).itemsize
    shape = tuple(shape) if len(shape) >= 2 else (1, *tuple(shape))
    sub = SUBLANES * max(1, 4 // itemsize)
    rows = -(-shape[-2] // sub) * sub
    lanes = -(-shape[-1] // LANES) * LANES
    return math.prod(shape[:-2]) * rows * lanes * itemsize


def vmem_bytes(blocks, scratch=(), temporaries=()) -> int:
    """VMEM of a kernel: ``blocks`` (``(shape, dtype)`` of each pipelined block) twice,
    ``scratch`` and the estimated live ``temporaries`` once."""
    return (
        2 * sum(tile_bytes(s, d) for s, d in blocks)
        + sum(tile_bytes(s, d) for s, d in scratch)
        + sum(tile_bytes(s, d) for s, d in temporaries)
    )


def compiler_params(name: str, need: int, semantics: Sequence[str]) -> pltpu.CompilerParams:
    """Mosaic parameters with ``vmem_limit_bytes`` from the kernel's budget ``need`` (1.25x,
    at least the 16 MiB default scope); ``ValueError`` above :data:`VMEM_CAP`."""
    if need > VMEM_CAP:
        raise ValueError(
            f"{name}: needs {need / MIB:.1f} MiB of VMEM, over the {VMEM_CAP // MIB} MiB of the "
            "smallest TPU VMEM (v7x); use fewer nodes, a smaller chunk or fewer stacked heads"
        )
    limit = min(VMEM_CAP, max(VMEM_DEFAULT, -(-int(need * 1.25) // MIB) * MIB))
    return pltpu.CompilerParams(dimension_semantics=tuple(semantics), vmem_limit_bytes=limit)


def check_head_dim(name: str, d: int) -> None:
    """ValueError for a head dim the TPU kernels do not take (a multiple of 8 in [8, 256])."""
    if d < 8 or d > 256 or d % 8:
        raise ValueError(f"{name}: the TPU kernels need a multiple of 8 in [8, 256], got {d}")


def check_dims(q, k, v, *, hk: int, hv: int, dk: int, dv: int) -> None:
    """ValueErrors for grouped heads that do not divide, head dims the TPU kernels do not take
    (:func:`check_head_dim`) and non-float inputs."""
    check_grouped_heads(hk, hv)
    check_head_dim("K", dk)
    check_head_dim("V", dv)
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_float(name, x, "TPU")


def lower_for_tpu(fn, *args, device_kind: str = "TPU v5 lite", num_cores: int = 1) -> str:
    """The StableHLO text of ``jax.jit(fn)`` on ``args`` (arrays or ``ShapeDtypeStruct``s)
    lowered for a TPU of ``device_kind`` on any host: runs the Pallas Mosaic lowering of every
    kernel inside (block shapes, memory spaces, the lowering rules of each op), not the Mosaic
    compiler itself."""
    dev = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=num_cores, platform="tpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*shapes).lower(lowering_platforms=("tpu",)).as_text()
