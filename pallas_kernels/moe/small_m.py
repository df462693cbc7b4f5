"""Routed experts for few tokens (decode, tree verify): every touched expert's weights read once.

    out[m] = sum_j w[m, j] * down_e( silu(x[m] gate_e) * (x[m] up_e) ),   e = experts[m, j]

No routing plan is built in XLA (no sort, no group sizes): the ``n = M * k`` expert ids go
straight to the two kernels, which read them as a power of two of lanes (``-1`` past ``n``). Program ``(p, j)`` of either grid
belongs to pair ``p``; it works only if ``p`` is the *first* pair routed to its expert ``e``
(no earlier pair has the same id), and then serves all of ``e``'s pairs: it compares ``e``
with the ``n`` ids, ranks the matches (a cumulative sum) and gathers them ``block_m`` at a time
into the rows of its dots. Every other program exits at once, so each touched expert is served
by exactly one program per column tile, and every pair's rows are written by exactly one
program (no atomics, deterministic).

1. **gate/up** (grid ``(n_pad, I / block_i)``): ``h = w * silu(x gate_e) * (x up_e)`` for a
   ``[block_m, block_i]`` tile; the loop over ``H`` reads ``gate_e[:, tile]`` and
   ``up_e[:, tile]`` once, gathering the pairs' token rows of ``x``. Stored (in the weights'
   dtype) at the pairs' rows of ``h [n + 1, I]`` with a masked scatter store.
2. **down** (grid ``(n_pad, H / block_h)``): ``y = h down_e[:, tile]``, the loop over ``I``
   reads ``down_e[:, tile]`` once; stored in f32 at the pairs' rows of ``y [n + 1, H]``.

Row ``n`` of ``h`` and ``y`` is a spare that the masked-off rows of a chunk point at; nothing
reads it.

Split reductions (``SmallMBlocks.split_k = s > 1``): at decode a few experts leave most SMs
idle and each program streams its whole column of weights with few bytes in flight, so each
kernel's reduction is split over a third grid axis of ``s`` programs (``s`` at most, a
divisor of the reduction's loop steps; by default as many as bring the kernel's busy programs
up to ``SmallMBlocks.target_programs``). Split gate/up programs store their f32 partial
``x gate_e`` and ``x up_e`` (``[s, n + 1, I]`` each); XLA adds the parts and applies the SiLU
product and the routing weight (one small fusion) before the down kernel; split down programs
store f32 partial ``y`` rows (``[s, n + 1, H]``), added before the combine. Rows of pairs with
invalid ids are never written, and never read: the down kernel reads only its expert's rows,
the combine drops invalid pairs.

The routing weight enters in kernel 1 (before the down projection, which is linear), so ``y``
rows are already weighted and the combine over a token's ``k`` pairs is one XLA reduction of
``y.reshape(M, k, H)`` over ``k`` (``M * k * H`` f32: 64 KiB at M 1, k 8, H 2048; against
atomics into ``out`` it costs one small fusion and keeps the sum order fixed).

Bytes at Qwen3.5-35B-A3B shapes (E 256, k 8, H 2048, I 512, bf16): ``3 H I * 2 B = 6.3 MB``
per touched expert (8 at M 1: 50 MB; about 100 at M 16), plus ``x``, ``h`` and ``y`` (under
1 MB). An expert with more than ``block_m`` pairs (skewed routing, repeated ids) loops over
row chunks and reads its weights once per chunk. Limit: ``n <= SmallMBlocks.max_pairs``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import _fit as fit
from pallas_kernels._wy import F32, next_pow2
from pallas_kernels.moe._common import (
    TileBlocks,
    check_moe_inputs,
    combine,
    fit_block,
    mm,
    swiglu,
    weight_precision,
)


@dataclasses.dataclass(frozen=True)
class SmallMBlocks(TileBlocks):
    """:class:`TileBlocks` plus ``max_pairs``: the most token-expert pairs ``M * k`` a call may
    have (each program compares its expert with all ``n`` ids and builds a
    ``[block_m, n_pad]`` selection); and ``split_k``: each kernel's reduction (``H`` for
    gate/up, ``I`` for down) split over that many programs (at most: the largest divisor of the
    reduction's loop steps not above it), their f32 partial sums added after the kernels
    (module docstring); 1: one program per tile; 0 (default): per kernel, as many as bring its
    busy programs (``min(E, M * k)`` experts times its column tiles) up to ``target_programs``
    (at decode, 8 at M 1 for gate/up and 4 for down; 1 from M 8 at Qwen3.5-35B-A3B's shapes).

    The tile defaults did best overall in a sweep on the H200 at Qwen3.5-35B-A3B's MoE
    (``bash benchmarks/device.sh moe_small_m``): 128 / 256 columns of ``I`` / ``H`` per program
    (256- and 512-byte contiguous rows of each weight tile), 32 rows of the reduction per loop
    step, five stages in flight."""

    block_i: int = 128
    block_h: int = 256
    block_kh: int = 32
    block_ki: int = 32
    num_stages: int = 5
    max_pairs: int = 512
    split_k: int = 0
    target_programs: int = 256

    def __post_init__(self):
        super().__post_init__()
        if self.max_pairs < 1:
            raise ValueError(f"max_pairs: at least 1, got {self.max_pairs}")
        if not isinstance(self.split_k, int) or self.split_k < 0:
            raise ValueError(f"split_k: an int >= 0 (0: automatic), got {self.split_k!r}")
        if self.target_programs < 1:
            raise ValueError(f"target_programs: at least 1, got {self.target_programs}")

    def parts(self, steps: int, tiles: int) -> int:
        """Programs sharing one reduction of ``steps`` loop steps when ``tiles`` (expert, column
        tile) programs are busy: the largest divisor of ``steps`` not above ``split_k``, or for
        ``split_k = 0`` not above ``max(1, target_programs // tiles)``."""
        want = self.split_k or max(1, self.target_programs // max(tiles, 1))
        return max(d for d in range(1, min(want, steps) + 1) if steps % d == 0)


DEFAULT_SMALL_M_BLOCKS = SmallMBlocks()


def _owner(ids_ref, num_experts: int, n: int, n_pad: int):
    """``(expert, active, count, rank)`` of program ``p``: its pair's expert id, whether ``p``
    is the first pair of a valid expert, the expert's number of pairs and each id's rank among
    them (``-1`` for other ids). ``ids_ref`` holds the ``n`` ids; they are read as ``n_pad``
    lanes, ``-1`` past ``n`` (a masked load: no padded copy of the ids)."""
    p = pl.program_id(0)
    pos = jax.lax.broadcasted_iota(jnp.int32, (n_pad,), 0)
    ids = plt.load(ids_ref.at[pl.ds(0, n_pad)], mask=pos < n, other=-1)
    e = jnp.where(p < n, ids_ref[jnp.minimum(p, n - 1)], -1)
    match = jnp.where(ids == e, 1, 0)
    earlier = jnp.sum(jnp.where(pos < p, match, 0))
    active = (earlier == 0) & (e >= 0) & (e < num_experts)
    rank = jnp.where(match > 0, jnp.cumsum(match) - 1, -1)
    return e, active, jnp.sum(match), rank


def _chunk_rows(rank, c, bm: int, n: int):
    """``(pair [bm], dest [bm], valid [bm])`` of the expert's pairs ``c * bm ..`` (by rank):
    ``pair`` is 0 on invalid rows (safe to gather through), ``dest`` is ``n`` there (the spare
    row of ``h`` and ``y``: masked stores write nothing on a GPU, and in interpret mode their
    unmasked copies then never collide with a valid row)."""
    want = c * bm + jax.lax.broadcasted_iota(jnp.int32, (bm, 1), 0)  # [bm, 1]
    sel = rank[None, :] == want  # [bm, n_pad]
    pos = jax.lax.broadcasted_iota(jnp.int32, sel.shape, 1)
    pair = jnp.sum(jnp.where(sel, pos, 0), axis=1)
    valid = jnp.sum(jnp.where(sel, 1, 0), axis=1) > 0
    return pair, jnp.where(valid, pair, n), valid


def _tile(rows, col0, width: int):
    """Int index arrays ``[len(rows), width]`` of the tile at ``rows`` x ``col0 ..`` (a gathered
    or scattered tile: all-array indices, which interpret mode needs for masked stores)."""
    r = jnp.broadcast_to(rows[:, None], (rows.shape[0], width))
    c = col0 + jax.lax.broadcasted_iota(jnp.int32, (rows.shape[0], width), 1)
    return r, c


def _gate_up_kernel(
    ids_ref,
    w_ref,
    x_ref,
    g_ref,
    u_ref,
    *out_refs,
    n,
    n_pad,
    k,
    num_experts,
    bm,
    bi,
    bk,
    precision,
    parts=1,
):
    j = pl.program_id(1)
    e, active, count, rank = _owner(ids_ref, num_experts, n, n_pad)
    nk = x_ref.shape[1] // bk
    lo = part = 0
    if parts > 1:  # this program's share of the H loop; partial sums out (module docstring)
        part = pl.program_id(2)
        lo, nk = part * (nk // parts), nk // parts
    cols = pl.ds(j * bi, bi)

    @pl.when(active)
    def _():
        def chunk(c, carry):
            pair, dest, valid = _chunk_rows(rank, c, bm, n)
            tok = pair // k

            def step(s, acc):
                ag, au = acc
                xs = x_ref[tok, pl.ds(s * bk, bk)].astype(g_ref.dtype)  # [bm, bk]
                ag = ag + mm(xs, g_ref[e, pl.ds(s * bk, bk), cols], precision)
                au = au + mm(xs, u_ref[e, pl.ds(s * bk, bk), cols], precision)
                return ag, au

            zero = jnp.zeros((bm, bi), F32)
            ag, au = jax.lax.fori_loop(lo, lo + nk, step, (zero, zero))
            mask = jnp.broadcast_to(valid[:, None], (bm, bi))
            if parts > 1:
                ag_ref, au_ref = out_refs
                rows = dest + part * (n + 1)
                plt.store(ag_ref.at[_tile(rows, j * bi, bi)], ag, mask=mask)
                plt.store(au_ref.at[_tile(rows, j * bi, bi)], au, mask=mask)
                return carry
            (h_ref,) = out_refs
            h = swiglu(ag, au) * w_ref[pair][:, None].astype(F32)
            plt.store(h_ref.at[_tile(dest, j * bi, bi)], h.astype(h_ref.dtype), mask=mask)
            return carry

        jax.lax.fori_loop(0, (count + bm - 1) // bm, chunk, 0)


def _down_kernel(
    ids_ref, h_ref, d_ref, y_ref, *, n, n_pad, num_experts, bm, bh, bk, precision, parts=1
):
    j = pl.program_id(1)
    e, active, count, rank = _owner(ids_ref, num_experts, n, n_pad)
    nk = h_ref.shape[1] // bk
    lo = part = 0
    if parts > 1:  # this program's share of the I loop, stored as a partial sum
        part = pl.program_id(2)
        lo, nk = part * (nk // parts), nk // parts
    cols = pl.ds(j * bh, bh)

    @pl.when(active)
    def _():
        def chunk(c, carry):
            _, dest, valid = _chunk_rows(rank, c, bm, n)

            def step(s, acc):
                hs = h_ref[dest, pl.ds(s * bk, bk)]  # [bm, bk]
                return acc + mm(hs, d_ref[e, pl.ds(s * bk, bk), cols], precision)

            y = jax.lax.fori_loop(lo, lo + nk, step, jnp.zeros((bm, bh), F32))
            mask = jnp.broadcast_to(valid[:, None], (bm, bh))
            rows = dest + part * (n + 1) if parts > 1 else dest
            plt.store(y_ref.at[_tile(rows, j * bh, bh)], y.astype(y_ref.dtype), mask=mask)
            return carry

        jax.lax.fori_loop(0, (count + bm - 1) // bm, chunk, 0)


def check_small_m(x, weights, experts, gate, up, down, blocks: SmallMBlocks):
    """``(M, k, E, H, I)``; ``ValueError`` for inputs the kernels cannot take (see
    :func:`pallas_kernels.moe._common.check_moe_inputs`) or more than ``blocks.max_pairs``
    pairs."""
    m, k, e, h, i = check_moe_inputs(x, weights, experts, gate, up, down)
    if m * k > blocks.max_pairs:
        raise ValueError(
            f"experts: the small-M MoE kernel takes at most {blocks.max_pairs} token-expert "
            f"pairs (M * k), got {m} * {k} = {m * k}; use the grouped kernel"
        )
    return m, k, e, h, i


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def routed_experts_small_m(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    *,
    blocks: SmallMBlocks = DEFAULT_SMALL_M_BLOCKS,
    interpret: bool = False,
) -> jax.Array:
    """``out [M, H]`` in the expert weights' dtype (module docstring).

    ``x [M, H]`` (cast to the weights' dtype), ``weights [M, k]`` float, ``experts int [M, k]``
    (ids outside ``[0, E)`` contribute nothing), ``gate, up [E, H, I]``, ``down [E, I, H]``.
    Raises ``ValueError`` before launching for inputs the kernels cannot take.
    """
    m, k, e, h, i = check_small_m(x, weights, experts, gate, up, down, blocks)
    n = m * k
    n_pad = next_pow2(n, 16)
    bm = blocks.block_m
    bi, bh = fit_block("I", i, blocks.block_i), fit_block("H", h, blocks.block_h)
    bkh, bki = fit_block("H", h, blocks.block_kh), fit_block("I", i, blocks.block_ki)
    ids = experts.reshape(-1).astype(jnp.int32)  # read as n_pad lanes by a masked load
    w = weights.reshape(-1)  # cast to f32 in the kernel
    prec = weight_precision(gate.dtype, blocks.precision, interpret)
    params = plt.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)
    whole = pl.BlockSpec(memory_space=None)
    busy = min(e, n)  # experts a call can touch
    pg = blocks.parts(h // bkh, busy * (i // bi))
    pd = blocks.parts(i // bki, busy * (h // bh))
    gate_up = functools.partial(
        _gate_up_kernel,
        n=n,
        n_pad=n_pad,
        k=k,
        num_experts=e,
        bm=bm,
        bi=bi,
        bk=bkh,
        precision=prec,
        parts=pg,
    )
    # one program per tile: h rows in the weights' dtype; split: the two f32 partial sums
    part = jax.ShapeDtypeStruct((pg * (n + 1), i), F32)
    gate_up_out = fit.pallas_call(
        gate_up,
        knobs=blocks,
        grid=(n_pad, i // bi) + ((pg,) if pg > 1 else ()),
        in_specs=[whole] * 5,
        out_specs=whole if pg == 1 else (whole, whole),
        out_shape=jax.ShapeDtypeStruct((n + 1, i), gate.dtype) if pg == 1 else (part, part),
        compiler_params=params,
        interpret=interpret,
        name="moe_small_m_gate_up",
    )(ids, w, x, gate, up)
    if pg == 1:
        h_pairs = gate_up_out
    else:
        ag, au = (a.reshape(pg, n + 1, i)[:, :n].sum(axis=0) for a in gate_up_out)
        hp = swiglu(ag, au) * w.astype(F32)[:, None]
        h_pairs = jnp.concatenate([hp, jnp.zeros((1, i), F32)]).astype(gate.dtype)
    y_pairs = fit.pallas_call(
        functools.partial(
            _down_kernel,
            n=n,
            n_pad=n_pad,
            num_experts=e,
            bm=bm,
            bh=bh,
            bk=bki,
            precision=prec,
            parts=pd,
        ),
        grid=(n_pad, h // bh) + ((pd,) if pd > 1 else ()),
        in_specs=[whole] * 3,
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((pd * (n + 1), h), F32),
        compiler_params=params,
        knobs=blocks,
        interpret=interpret,
        name="moe_small_m_down",
    )(ids, h_pairs, down)
    if pd > 1:
        y_pairs = y_pairs.reshape(pd, n + 1, h)[:, :n].sum(axis=0)
    flat = experts.reshape(-1)
    return combine(y_pairs[:n], (flat >= 0) & (flat < e), m, k, gate.dtype)
