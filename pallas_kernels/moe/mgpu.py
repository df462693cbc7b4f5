"""Routed experts through jax's Mosaic GPU grouped matmul (``ragged_dot_mgpu``), Hopper only.

    out[m] = sum_j w[m, j] * down_e( silu(x[m] gate_e) * (x[m] up_e) ),   e = experts[m, j]

The ``M * k`` pairs are sorted by expert (stable argsort, group sizes by ``bincount``, as the
XLA path), the token rows of ``x`` gathered into sorted order, and the three projections run
as :func:`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu.ragged_dot` calls over the sorted
rows (each output rounded to the weights' dtype, as ``lax.ragged_dot``). ``silu(g) * u`` times
the routing weight is one XLA fusion between them; the combine gathers each pair's row and sums
a token's ``k`` rows in f32.

Off interpret mode :func:`routed_experts_mgpu` raises ``ValueError`` unless the default
backend is a compute capability 9.x GPU (the kernel issues ``wgmma``). With ``interpret=True``
it runs on any backend in Mosaic GPU's interpret mode (``plgpu.force_gpu_interpret_mode``: the
GPU's memory spaces, threads, TMA copies and ``wgmma`` simulated on the host), which is how the
CPU tests check it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._wy import F32
from pallas_kernels.moe._common import check_moe_inputs, combine, sort_pairs, swiglu


@dataclasses.dataclass(frozen=True)
class MgpuBlocks:
    """Knobs of ``ragged_dot_mgpu.ragged_dot``: output tile ``block_m x block_n``, reduction
    step ``block_k``, pipeline depth ``max_concurrent_steps``, and ``grid_block_n`` (column
    tiles per step of the snake over the output). ``block_k`` must divide ``H`` and ``I``,
    ``block_n`` must divide ``H`` and ``I``."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4
    grid_block_n: int = 1

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 8 or v & (v - 1):
                raise ValueError(f"{name}: a power of two >= 8, got {v}")
        if self.max_concurrent_steps < 1 or self.grid_block_n < 1:
            raise ValueError("max_concurrent_steps, grid_block_n: at least 1")


DEFAULT_MGPU_BLOCKS = MgpuBlocks()


def mgpu_available() -> bool:
    """Whether the default backend can run the Mosaic GPU grouped matmul (a Hopper GPU)."""
    if jax.default_backend() != "gpu":
        return False
    cc = getattr(jax.devices()[0], "compute_capability", "")
    return str(cc).startswith("9")


def check_mgpu(x, weights, experts, gate, up, down, blocks: MgpuBlocks, interpret=False):
    """``(M, k, E, H, I)``; ``ValueError`` for inputs or a machine the wrapper cannot take
    (any machine in interpret mode)."""
    m, k, e, h, i = check_moe_inputs(x, weights, experts, gate, up, down)
    if jnp.dtype(gate.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(
            f"gate: ragged_dot_mgpu takes bfloat16 or float16 weights, got {gate.dtype}"
        )
    for name, size in (("H", h), ("I", i)):
        if size % blocks.block_k or size % blocks.block_n:
            raise ValueError(
                f"{name}: ragged_dot_mgpu needs a multiple of block_k = {blocks.block_k} and "
                f"block_n = {blocks.block_n}, got {size}"
            )
    check_hopper("the Mosaic GPU grouped matmul", interpret)
    return m, k, e, h, i


def check_hopper(what: str, interpret: bool) -> None:
    """``ValueError`` naming ``impl`` unless ``interpret`` or a Hopper GPU can run ``what``."""
    if not interpret and not mgpu_available():
        raise ValueError(
            f"impl: {what} needs a compute capability 9.x GPU (or interpret=True); the "
            f"default backend is {jax.default_backend()}"
        )


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def routed_experts_mgpu(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    *,
    blocks: MgpuBlocks = DEFAULT_MGPU_BLOCKS,
    interpret: bool = False,
) -> jax.Array:
    """``out [M, H]`` in the expert weights' dtype (module docstring); same arguments as
    :func:`pallas_kernels.moe.routed_experts_grouped`, bf16 or f16 weights; a Hopper GPU, or any
    backend with ``interpret=True``."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    m, k, e, h, i = check_mgpu(x, weights, experts, gate, up, down, blocks, interpret)
    n = m * k
    rd = functools.partial(
        ragged_dot_mgpu.ragged_dot,
        block_m=blocks.block_m,
        block_n=blocks.block_n,
        block_k=blocks.block_k,
        max_concurrent_steps=blocks.max_concurrent_steps,
        grid_block_n=blocks.grid_block_n,
    )
    order, sizes, _ = sort_pairs(experts, e)  # invalid ids sort last, past every group
    flat = experts.reshape(-1)
    valid = (flat >= 0) & (flat < e)
    xs = x[order // k].astype(gate.dtype)
    with plgpu.force_gpu_interpret_mode() if interpret else contextlib.nullcontext():
        g = rd(xs, gate, group_sizes=sizes)
        u = rd(xs, up, group_sizes=sizes)
        w = weights.reshape(-1)[order].astype(F32)
        hs = (swiglu(g.astype(F32), u.astype(F32)) * w[:, None]).astype(gate.dtype)
        y = rd(hs, down, group_sizes=sizes)
    pos = jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
    return combine(y[pos], valid, m, k, gate.dtype)
