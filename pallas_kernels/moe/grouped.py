"""Routed experts for many tokens (prefill): a grouped GEMM over expert-aligned row blocks.

    out[m] = sum_j w[m, j] * down_e( silu(x[m] gate_e) * (x[m] up_e) ),   e = experts[m, j]

**Plan (XLA, on device).** The ``n = M * k`` token-expert pairs are sorted by expert (stable
argsort); expert ``e`` with ``c_e`` pairs gets ``ceil(c_e / block_m)`` consecutive row blocks
of ``block_m`` rows (the last one padded), so every block belongs to one expert. The static
block count is the bound ``NB = (n - T) // block_m + T`` with ``T = min(E, n)`` (the most
blocks any routing can need); blocks past the used ones have expert ``-1``. Per padded row:
its token and routing weight (padding rows: token 0, weight 0); per pair: its padded row.

**Kernels** (Triton lowering; a 1-D grid over ``(block, column tile)`` in groups of
``group_m`` blocks, so the blocks of one expert run side by side and share its weight tiles
in L2):

1. **gate/up** (``NB * I / block_i`` programs): for block ``b`` of expert ``e`` and column tile
   ``j``, ``h = w * silu(x gate_e[:, j]) * (x up_e[:, j])`` as ``[block_m, block_i]``, looping
   over ``H`` in ``block_kh`` steps and gathering the block's token rows of ``x``; stored in the
   weights' dtype at the block's rows of ``h [NB * block_m, I]`` (plain block stores).
2. **down** (``NB * H / block_h`` programs): ``y = h down_e[:, j]`` for ``[block_m, block_h]``,
   looping over ``I``; stored at the block's rows of ``y [NB * block_m, H]`` in f32
   (``GroupedBlocks.pair_f32``) or in the weights' dtype.

The combine gathers each pair's row of ``y`` and sums a token's ``k`` rows in f32 (one XLA
fusion). Each expert's weights are read ``ceil(c_e / block_m)`` times (once per block; from L2
for blocks running together). Bytes: weights ``sum_e ceil(c_e / block_m) * 3 H I`` elements,
``x`` gathered ``I / block_i`` times per block, ``h`` written and read, ``y`` written and read.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import _fit as fit
from pallas_kernels._wy import F32
from pallas_kernels.moe._common import (
    TileBlocks,
    check_moe_inputs,
    combine,
    fit_block,
    mm,
    sort_pairs,
    swiglu,
    weight_precision,
)


@dataclasses.dataclass(frozen=True)
class GroupedBlocks(TileBlocks):
    """:class:`TileBlocks` for the grouped GEMM plus ``group_m`` (row blocks per program group
    of the swizzled grid) and ``pair_f32`` (store the per-pair down rows in f32; ``False``:
    in the weights' dtype, half the bytes for bf16)."""

    block_m: int = 64
    block_i: int = 64
    block_h: int = 128
    block_kh: int = 64
    block_ki: int = 64
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8
    pair_f32: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.group_m < 1:
            raise ValueError(f"group_m: at least 1, got {self.group_m}")


DEFAULT_GROUPED_BLOCKS = GroupedBlocks()


def max_blocks(n: int, num_experts: int, bm: int) -> int:
    """The most ``bm``-row expert blocks ``n`` pairs can need: ``sum_e ceil(c_e / bm)`` over
    ``T <= min(E, n)`` touched experts is at most ``(n - T) / bm + T``, increasing in ``T``."""
    t = min(num_experts, n)
    return (n - t) // bm + t


class Plan(NamedTuple):
    """The routing plan of the grouped kernels (module docstring)."""

    row_token: jax.Array  # int32 [NB * bm]: token of each padded row (0 on padding)
    row_weight: jax.Array  # f32 [NB * bm]: routing weight of each padded row (0 on padding)
    block_expert: jax.Array  # int32 [NB]: expert of each block, -1 past the used blocks
    pair_row: jax.Array  # int32 [n]: padded row of each pair (m * k + j)
    valid: jax.Array  # bool [n]: the pair's expert id lies in [0, E)


def make_plan(weights, experts, num_experts: int, bm: int) -> Plan:
    """The padded expert-block layout of the ``M * k`` pairs (module docstring); pairs with
    ids outside ``[0, E)`` get no row."""
    m, k = experts.shape
    n = m * k
    nb = max_blocks(n, num_experts, bm)
    rows = nb * bm
    flat = experts.reshape(-1).astype(jnp.int32)
    valid = (flat >= 0) & (flat < num_experts)
    order, sizes, ok = sort_pairs(experts, num_experts)  # order: sorted position -> pair
    order = order.astype(jnp.int32)
    se = jnp.where(ok, flat[order], num_experts)  # sorted expert ids, E for invalid ones
    nblk = (sizes + bm - 1) // bm
    block_start = jnp.cumsum(nblk) - nblk
    group_start = jnp.cumsum(sizes) - sizes
    ec = jnp.minimum(se, num_experts - 1)
    t = jnp.arange(n, dtype=jnp.int32) - group_start[ec]  # rank within the expert
    row = (block_start[ec] + t // bm) * bm + t % bm
    row = jnp.where(se < num_experts, row, rows)  # invalid ids: dropped by the scatters
    w = weights.reshape(-1)[order].astype(F32)
    return Plan(
        row_token=jnp.zeros((rows,), jnp.int32).at[row].set(order // k, mode="drop"),
        row_weight=jnp.zeros((rows,), F32).at[row].set(w, mode="drop"),
        block_expert=jnp.full((nb,), -1, jnp.int32).at[row // bm].set(se, mode="drop"),
        pair_row=jnp.zeros((n,), jnp.int32).at[order].set(jnp.minimum(row, rows - 1)),
        valid=valid,
    )


def _swizzle(pid, nb: int, nt: int, group: int):
    """``(block, column tile)`` of program ``pid`` on a grid of ``nb * nt``: consecutive
    programs walk ``group`` blocks down one column tile before moving to the next tile."""
    per_group = group * nt
    first = (pid // per_group) * group
    size = jnp.minimum(nb - first, group)
    local = pid % per_group
    return first + local % size, local // size


def _gate_up_kernel(be_ref, tok_ref, w_ref, x_ref, g_ref, u_ref, h_ref, *, where, bi, bk, prec):
    b, j = where(pl.program_id(0))
    e = be_ref[b]
    nk = x_ref.shape[1] // bk
    cols = pl.ds(j * bi, bi)

    @pl.when(e >= 0)
    def _():
        tok = tok_ref[...]  # [bm]

        def step(s, acc):
            ag, au = acc
            xs = x_ref[tok, pl.ds(s * bk, bk)].astype(g_ref.dtype)  # [bm, bk] gathered rows
            ag = ag + mm(xs, g_ref[e, pl.ds(s * bk, bk), cols], prec)
            au = au + mm(xs, u_ref[e, pl.ds(s * bk, bk), cols], prec)
            return ag, au

        zero = jnp.zeros((tok.shape[0], bi), F32)
        ag, au = jax.lax.fori_loop(0, nk, step, (zero, zero))
        h = swiglu(ag, au) * w_ref[...][:, None]
        h_ref[...] = h.astype(h_ref.dtype)


def _down_kernel(be_ref, h_ref, d_ref, y_ref, *, where, bh, bk, prec):
    b, j = where(pl.program_id(0))
    e = be_ref[b]
    nk = h_ref.shape[1] // bk

    @pl.when(e >= 0)
    def _():
        def step(s, acc):
            return acc + mm(
                h_ref[:, pl.ds(s * bk, bk)], d_ref[e, pl.ds(s * bk, bk), pl.ds(j * bh, bh)], prec
            )

        y_ref[...] = jax.lax.fori_loop(0, nk, step, jnp.zeros(y_ref.shape, F32)).astype(y_ref.dtype)


def grouped_tiles(h: int, i: int, blocks: GroupedBlocks) -> tuple[int, int, int, int]:
    """``(block_i, block_h, block_kh, block_ki)`` fitted to ``H`` and ``I``; ``ValueError`` when
    ``H`` or ``I`` is not a multiple of 16."""
    return (
        fit_block("I", i, blocks.block_i),
        fit_block("H", h, blocks.block_h),
        fit_block("H", h, blocks.block_kh),
        fit_block("I", i, blocks.block_ki),
    )


def check_grouped(x, weights, experts, gate, up, down, blocks: GroupedBlocks) -> None:
    """``ValueError`` for inputs the grouped kernels cannot take."""
    _, _, _, h, i = check_moe_inputs(x, weights, experts, gate, up, down)
    grouped_tiles(h, i, blocks)


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def routed_experts_grouped(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    *,
    blocks: GroupedBlocks = DEFAULT_GROUPED_BLOCKS,
    interpret: bool = False,
) -> jax.Array:
    """``out [M, H]`` in the expert weights' dtype (module docstring).

    ``x [M, H]`` (cast to the weights' dtype), ``weights [M, k]`` float, ``experts int [M, k]``
    (ids outside ``[0, E)`` contribute nothing), ``gate, up [E, H, I]``, ``down [E, I, H]``.
    Raises ``ValueError`` before launching for inputs the kernels cannot take.
    """
    m, k, e, h, i = check_moe_inputs(x, weights, experts, gate, up, down)
    bm = blocks.block_m
    bi, bh, bkh, bki = grouped_tiles(h, i, blocks)
    plan = make_plan(weights, experts, e, bm)
    nb = plan.block_expert.shape[0]
    prec = weight_precision(gate.dtype, blocks.precision, interpret)
    params = plt.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)
    whole = pl.BlockSpec(memory_space=None)
    rows = nb * bm

    nt1 = i // bi
    where1 = functools.partial(_swizzle, nb=nb, nt=nt1, group=blocks.group_m)
    row_spec = pl.BlockSpec((bm,), lambda p: (where1(p)[0],))
    h_rows = fit.pallas_call(
        functools.partial(_gate_up_kernel, where=where1, bi=bi, bk=bkh, prec=prec),
        grid=(nb * nt1,),
        in_specs=[whole, row_spec, row_spec, whole, whole, whole],
        out_specs=pl.BlockSpec((bm, bi), where1),
        out_shape=jax.ShapeDtypeStruct((rows, i), gate.dtype),
        compiler_params=params,
        knobs=blocks,
        interpret=interpret,
        name="moe_grouped_gate_up",
    )(plan.block_expert, plan.row_token, plan.row_weight, x, gate, up)

    nt2 = h // bh
    where2 = functools.partial(_swizzle, nb=nb, nt=nt2, group=blocks.group_m)
    y_dtype = F32 if blocks.pair_f32 else gate.dtype
    y_rows = fit.pallas_call(
        functools.partial(_down_kernel, where=where2, bh=bh, bk=bki, prec=prec),
        grid=(nb * nt2,),
        in_specs=[whole, pl.BlockSpec((bm, i), lambda p: (where2(p)[0], 0)), whole],
        out_specs=pl.BlockSpec((bm, bh), where2),
        out_shape=jax.ShapeDtypeStruct((rows, h), y_dtype),
        compiler_params=params,
        knobs=blocks,
        interpret=interpret,
        name="moe_grouped_down",
    )(plan.block_expert, h_rows, down)
    return combine(y_rows[plan.pair_row], plan.valid, m, k, gate.dtype)
