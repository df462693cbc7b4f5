"""Commit of an accepted chain of a verified draft tree (docs/design.md, "Commit of an
accepted chain"), in place.

    S_new = exp(G_last) S0 + K^T (c * U),   c_n = exp(G_last - G_n) if n on the path else 0

which equals ``exp(G_last) S0 + K_path^T (w * U_path)``. By default the kernel gathers the path's
rows of ``k``, ``U`` and ``G`` through the path ids (``CommitBlocks.gather``); with
``gather=False`` it reads all ``N`` rows and selects the path by a mask over the node axis (paths
are distinct nodes). bf16 keys enter the dot raw (exact products; the l2norm becomes a row scale
of the weights, which are split into two bf16 halves). One program per (batch row, value head,
block of value columns); ``S0`` is aliased to the output, so a donated state is updated in place.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._wy import (
    F32,
    L2NORM_EPS,
    DotBlocks,
    check_float,
    check_max_nodes,
    check_pow2_dim,
    dot,
    dot_precision,
    mask_path,
    masked_decay,
    next_pow2,
    pad_axis,
    prep_rows,
)
from pallas_kernels.verify.kernel import GPU_SHARED_MEMORY, MAX_NODES


@dataclasses.dataclass(frozen=True)
class CommitBlocks(DotBlocks):
    """:class:`DotBlocks` plus ``gather``: load only the path's rows of ``k``, ``U`` and ``G``
    (a gather through the path ids) instead of all ``N`` rows under a mask."""

    gather: bool = True


DEFAULT_COMMIT_BLOCKS = CommitBlocks()


def _kernel(
    s0_ref, k_ref, u_ref, gp_ref, path_ref, out_ref, *, use_l2norm, precision, interpret, gather
):
    path = path_ref[...]  # [D], -1 past path_len
    d = path.shape[0]
    pos = jax.lax.broadcasted_iota(jnp.int32, (d,), 0)
    d_last = jnp.max(jnp.where(path >= 0, pos, -1))
    if gather:
        # Rows in path order; rows past path_len read node 0 and get weight 0.
        rows = jnp.maximum(path, 0)
        g_rows = gp_ref[rows]
        kr, ur = k_ref[rows, :], u_ref[rows, :]
        g_last = jnp.sum(jnp.where(pos == d_last, g_rows, 0.0))
        on_path = path >= 0
    else:
        g_rows = gp_ref[...]
        n = g_rows.shape[0]
        node = jax.lax.broadcasted_iota(jnp.int32, (d, n), 1)
        on_path = jnp.max(jnp.where(path[:, None] == node, 1, 0), axis=0) > 0  # [N]
        last = jnp.sum(jnp.where(pos == d_last, path, 0))
        ids = jax.lax.broadcasted_iota(jnp.int32, (n,), 0)
        g_last = jnp.sum(jnp.where(ids == last, g_rows, 0.0))
        kr, ur = k_ref[...], u_ref[...]
    g_last = jnp.where(d_last >= 0, g_last, 0.0)
    c = masked_decay(g_last, g_rows, on_path)
    if kr.dtype == jnp.bfloat16:
        # Raw bf16 keys enter the dot as they are (exact products); the l2norm is a row scale
        # of the weights, and the f32 weights are split into two bf16 halves (2 passes).
        if use_l2norm:
            kf = kr.astype(F32)
            c = c * jax.lax.rsqrt(jnp.sum(kf * kf, axis=1) + L2NORM_EPS)
        w = c[:, None] * ur
        w_hi = w.astype(jnp.bfloat16)
        w_lo = (w - w_hi.astype(F32)).astype(jnp.bfloat16)
        one = None if interpret else jax.lax.DotAlgorithmPreset.BF16_BF16_F32
        upd = dot(kr, w_hi, one, trans_a=True) + dot(kr, w_lo, one, trans_a=True)
    else:
        k = prep_rows(kr, use_l2norm)
        upd = dot(k, c[:, None] * ur, precision, trans_a=True)
    out_ref[...] = jnp.exp(g_last) * s0_ref[...] + upd


def commit_shared_memory(npad: int, dk: int, bv: int, low: bool, precision: str) -> int:
    """Bytes of shared memory per block that the commit kernel's GPU build asks for (sm_90,
    jax 0.11.2's XLA Triton pipeline): ``npad`` padded nodes, key dim ``dk``, ``bv`` value
    columns per program, ``low`` for bf16 keys (raw bf16 k and the two bf16 halves of the
    weights: ``2 N dk + 4 N bv``), else the ``K^T (c U)`` dot's split operands, ``e N (dk + bv)``
    with ``e`` 8 bytes per element for tf32x3 and 4 otherwise; at least ``4 dk bv``. Fitted to
    deviceless compiles (``benchmarks/results/compile_report/verify_smem.json``: N 16 to 128,
    K 64 to 256, block_v 32 to 128): equal to the build's figure on 132 of 180 configurations,
    above it on the rest, refusing none that would fit."""
    if low:
        need = 2 * npad * dk + 4 * npad * bv
    else:
        need = (8 if precision == "tf32x3" else 4) * npad * (dk + bv)
    return max(need, 4 * dk * bv)


class CommitLaunch(NamedTuple):
    """Padded commit inputs, their block specs on the (row, value head, column block) grid, and
    the kernel body (``(s0_ref, k_ref, u_ref, gp_ref, path_ref, out_ref)``)."""

    args: tuple
    in_specs: list
    grid: tuple[int, int, int]
    bv: int
    body: Callable


def prepare_commit_launch(
    k, u, g_path, path, path_len, blocks: CommitBlocks, *, use_qk_l2norm: bool, interpret: bool
) -> CommitLaunch:
    """Checks the commit's inputs (ValueError naming the limit; off interpret mode also the
    GPU's shared memory per block, :func:`commit_shared_memory`), pads ``N`` and the path to
    powers of two >= 16 (path entries past ``path_len`` become -1), and builds the specs."""
    b, n, hk, dk = k.shape
    hv, dv = u.shape[2], u.shape[3]
    check_max_nodes(n, MAX_NODES, "Pallas tree_commit kernel")
    check_pow2_dim("K", dk)
    check_pow2_dim("V", dv)
    check_float("k", k)
    bv = min(blocks.block_v, dv)
    npad = next_pow2(n, 16)
    low = k.dtype == jnp.bfloat16
    need = commit_shared_memory(npad, dk, bv, low, blocks.precision)
    if not interpret and need > GPU_SHARED_MEMORY:
        raise ValueError(
            f"N: on GPU the tree_commit kernel for {n} nodes (padded to {npad}), {k.dtype} keys, "
            f"K {dk}, block_v {bv} and precision={blocks.precision!r} needs {need // 1024} KiB of "
            f"shared memory per block, over the 227 KiB ({GPU_SHARED_MEMORY} bytes) of the H200; "
            "use a smaller block_v, precision='bf16x3' or the XLA path"
        )
    k, u, g_path = (pad_axis(x, 1, npad) for x in (k, u, g_path))
    dpad = next_pow2(path.shape[1], 16)
    path = mask_path(path, path_len, dpad)
    grp = hv // hk
    body = functools.partial(
        _kernel,
        use_l2norm=use_qk_l2norm,
        precision=dot_precision(blocks.precision, interpret),
        interpret=interpret,
        gather=getattr(blocks, "gather", False),
    )
    in_specs = [
        pl.BlockSpec((None, npad, None, dk), lambda i, h, j: (i, 0, h // grp, 0)),
        pl.BlockSpec((None, npad, None, bv), lambda i, h, j: (i, 0, h, j)),
        pl.BlockSpec((None, npad, None), lambda i, h, j: (i, 0, h)),
        pl.BlockSpec((None, dpad), lambda i, h, j: (i, 0)),
    ]
    return CommitLaunch((k, u, g_path, path), in_specs, (b, hv, dv // bv), bv, body)


def tree_commit(
    initial_state: jax.Array,
    k: jax.Array,
    u: jax.Array,
    g_path: jax.Array,
    path: jax.Array,
    path_len: jax.Array,
    *,
    use_qk_l2norm: bool = False,
    blocks: CommitBlocks = DEFAULT_COMMIT_BLOCKS,
    interpret: bool = False,
) -> jax.Array:
    """New state f32 ``[B, Hv, K, V]`` after ``path[b, :path_len[b]]`` (root to leaf).

    ``k [B, N, Hk, K]`` raw keys (l2-normalised in-kernel when ``use_qk_l2norm``), ``u`` f32
    ``[B, N, Hv, V]``, ``g_path`` f32 ``[B, N, Hv]``, ``path`` int ``[B, D]``, ``path_len [B]``.
    ``initial_state`` (f32) is aliased to the result: donate it to update in place.
    """
    t = prepare_commit_launch(
        k, u, g_path, path, path_len, blocks, use_qk_l2norm=use_qk_l2norm, interpret=interpret
    )
    b, hv, dk, dv = t.grid[0], t.grid[1], k.shape[3], u.shape[3]
    s_spec = pl.BlockSpec((None, None, dk, t.bv), lambda i, h, j: (i, h, 0, j))
    return pl.pallas_call(
        t.body,
        grid=t.grid,
        in_specs=[s_spec, *t.in_specs],
        out_specs=s_spec,
        out_shape=jax.ShapeDtypeStruct((b, hv, dk, dv), F32),
        input_output_aliases={0: 0},
        compiler_params=plt.CompilerParams(
            num_warps=blocks.num_warps, num_stages=blocks.num_stages
        ),
        interpret=interpret,
        name="gdn_tree_commit",
    )(initial_state.astype(F32), *t.args)
