"""Tree WY verify in two kernels ("split"): the per-head N x N work once, the value columns apart.

An experiment against the fused :func:`pallas_kernels.tree_verify` (same inputs, same outputs).
The fused kernel runs one program per (batch row, value head, block of value columns), so with
``block_v = 64`` of ``V = 128`` both programs of a head repeat every ``N x N`` step (products,
inverse, refinement): ~30 dependent small dots per program at 255 registers, 2 programs per SM,
5-7x over the HBM floor on the H200. Here (``P`` the inclusive ancestor mask, ``G = P g``,
``D[n, i] = exp(G_n - G_i)`` on ``P``, ``rq, rk`` the l2norm/scale row factors of ``q, k``)::

    Kernel A, grid (B, Hv), one program per (row, head): depends on q, k, g, beta, tree only
        A  = diag(beta) ((K K^T) * D * strict(P))          (K = diag(rk) k)
        M  = (I + A)^-1 diag(beta)                         f32 [N, N]   -> HBM
        P2 = (Q K^T) * D                                   f32 [N, N]   -> HBM (Q = diag(rq) q)
        ck = e^G rk,  cq = e^G rq,  G                      f32 [N]      -> HBM
    Kernel B, grid (B, Hv, V // block_v): loads S0[:, block], raw q, k, v[:, block], M, P2, ck, cq
        W = V - diag(ck) (k S0);  U = M W;  O = diag(cq) (q S0) + P2 U  -> U (f32), O

Precision (as the fused "refine" kernel): bf16 q/k enter their dots raw (exact bf16 products,
f32 accumulation; the row factors are applied after), the f32 state is split into two bf16
halves for ``k S0`` and ``q S0``; f32/f16 q/k run those dots at ``precision`` (3 passes).
``M`` is built from an approximate inverse ``T0`` (product doubling in single-pass
``inverse_precision`` dots, as many doublings as the tree is deep) refined as a matrix,
``M <- M + T0 (diag(beta) - (I + A) M)`` (``refine_steps``; the residual's ``A M`` at
``precision``): each step multiplies the error by ``|I - T0 (I + A)|`` (~4e-3 for a bf16
``T0``), so two steps give ``M`` to f32 level. ``M W`` and ``P2 U`` run at ``precision``.
CPU interpret mode has no single-pass bf16 dots, so there ``A`` is rounded to bf16 before the
doubling: ``T0`` then carries a GPU-like error and the tests exercise the refinement.

HBM cost on top of the fused kernel: ``M`` and ``P2`` make a round trip, ``2 N^2 4`` bytes
written by kernel A and read by kernel B per (row, head) (each of the ``V / block_v`` column
programs reads them; after the first, mostly from L2), plus ``3 N 4`` bytes of row factors and
``G``. At N = 64, K = V = 128 that is 32 KiB written + 32 KiB read per head, against the fused
kernel's ~145 KiB per head (S0 64 KiB, U 32 KiB, v and O 16 KiB each in bf16, q and k 16 KiB at
Hv = 2 Hk): the floor rises ~1.45x, the bet being that kernel B (6 dots, no dependence chain
through an inverse) and kernel A (one program per head, no repeated work) run closer to it.
At N = 16 the round trip is 4 KiB per head (~5%). Limits: N <= 128 as the fused kernel (both
kernels lower to Triton IR up to there; at N = 128 kernel B holds two 64 KiB f32 ``N x N``
tiles, untimed).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._wy import (
    F32,
    PRECISIONS,
    ancestor_closure,
    check_blocks,
    check_max_nodes,
    dot,
    dot_precision,
    masked_decay,
    pad_axis,
    prepare_tree_launch,
)
from pallas_kernels.verify.kernel import (
    BF16,
    MAX_NODES,
    ONE_PASS,
    _one_pass,
    _rows_scale,
    inverse_by_depth,
    tree_input,
)


@dataclasses.dataclass(frozen=True)
class SplitVerifyBlocks:
    """Static knobs of the split verify.

    ``block_v``: value columns per kernel-B program (power of two >= 16; capped at ``V``);
    ``num_warps_a`` / ``num_warps_b``: Triton warps of kernel A (per head) and kernel B (per
    column block); ``num_stages``: Triton stages of both; ``precision``: the 3-pass dots
    (``"tf32x3"``, ``"bf16x3"`` or ``"highest"``); ``inverse_precision``: the single-pass dots
    of the approximate inverse ``T0`` and of the refinement's correction (``"bf16"`` or
    ``"tf32"``); ``refine_steps``: refinement steps of ``M`` (0..4); ``ancestors_input``:
    kernel A loads the inclusive ancestor mask (``ancestors=``, or computed with XLA per call)
    instead of squaring ``I + onehot(parent)`` itself.
    """

    block_v: int = 64
    num_warps_a: int = 4
    num_warps_b: int = 4
    num_stages: int = 1
    precision: str = "tf32x3"
    inverse_precision: str = "bf16"
    refine_steps: int = 2
    ancestors_input: bool = False

    def __post_init__(self):
        if self.block_v < 16 or self.block_v & (self.block_v - 1):
            raise ValueError(f"blocks.block_v: a power of two >= 16, got {self.block_v}")
        if self.precision not in PRECISIONS:
            raise ValueError(
                f"blocks.precision: one of {tuple(PRECISIONS)}, got {self.precision!r}"
            )
        if self.inverse_precision not in ONE_PASS:
            raise ValueError(
                f"blocks.inverse_precision: one of {tuple(ONE_PASS)}, got {self.inverse_precision!r}"
            )
        if not 0 <= self.refine_steps <= 4:
            raise ValueError(f"blocks.refine_steps: 0..4, got {self.refine_steps}")


DEFAULT_SPLIT_BLOCKS = SplitVerifyBlocks()


class SplitMatrices(NamedTuple):
    """Kernel A's outputs on the padded ``Np`` nodes (``Np``: ``N`` padded to a power of two
    >= 16): ``m = (I + A)^-1 diag(beta)`` and ``p2 = (Q K^T) * D``, f32 ``[B, Hv, Np, Np]``;
    ``g_path`` f32 ``[B, Np, Hv]``; row factors ``ck = e^G rk``, ``cq = e^G rq`` f32
    ``[B, Hv, Np]``."""

    m: jax.Array
    p2: jax.Array
    g_path: jax.Array
    ck: jax.Array
    cq: jax.Array


def _is_low(qr, kr) -> bool:
    return qr.dtype == BF16 and kr.dtype == BF16


def _matrices_kernel(
    q_ref,
    k_ref,
    g_ref,
    beta_ref,
    tree_ref,
    m_ref,
    p2_ref,
    gp_ref,
    ck_ref,
    cq_ref,
    *,
    scale,
    use_l2norm,
    blocks: SplitVerifyBlocks,
    interpret,
):
    """Kernel A: one (row, head). Everything that does not touch S0 or v."""
    x3 = dot_precision(blocks.precision, interpret)
    inv_p = _one_pass(blocks.inverse_precision, interpret)
    qr, kr = q_ref[...], k_ref[...]
    rq = _rows_scale(qr, use_l2norm, scale)
    rk = _rows_scale(kr, use_l2norm, None)
    if _is_low(qr, kr):
        one = _one_pass("bf16", interpret)
        kk = dot(kr, kr, one, trans_b=True)
        qk = dot(qr, kr, one, trans_b=True)
    else:
        qf, kf = qr.astype(F32), kr.astype(F32)
        kk = dot(kf, kf, x3, trans_b=True)
        qk = dot(qf, kf, x3, trans_b=True)
    kk = kk * rk[:, None] * rk[None, :]
    qk = qk * rq[:, None] * rk[None, :]

    incl = tree_ref[...] != 0 if blocks.ancestors_input else ancestor_closure(tree_ref[...])
    n = incl.shape[0]
    row = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)
    strict = incl & (row != col)
    g_path = jnp.sum(jnp.where(incl, g_ref[...].astype(F32)[None, :], 0.0), axis=1)
    decay = masked_decay(g_path[:, None], g_path[None, :], incl)
    beta = beta_ref[...].astype(F32)
    a = beta[:, None] * jnp.where(strict, decay, 0.0) * kk

    a_inv = a
    if interpret and blocks.inverse_precision == "bf16":
        a_inv = a.astype(BF16).astype(F32)  # GPU-like T0 error on CPU (module docstring)
    depth = jnp.max(jnp.sum(jnp.where(incl, 1, 0), axis=1))
    t0 = inverse_by_depth(a_inv, depth, inv_p)
    m = t0 * beta[None, :]
    diag_beta = jnp.where(row == col, beta[None, :], 0.0)
    for _ in range(blocks.refine_steps):
        r = diag_beta - m - dot(a, m, x3)
        m = m + dot(t0, r, inv_p)
    eg = jnp.exp(g_path)
    m_ref[...] = m
    p2_ref[...] = qk * decay
    gp_ref[...] = g_path
    ck_ref[...] = eg * rk
    cq_ref[...] = eg * rq


def _apply_kernel(
    q_ref,
    k_ref,
    v_ref,
    s0_ref,
    m_ref,
    p2_ref,
    ck_ref,
    cq_ref,
    o_ref,
    u_ref,
    *,
    blocks: SplitVerifyBlocks,
    interpret,
):
    """Kernel B: one (row, head, column block). Six dots, no inverse."""
    x3 = dot_precision(blocks.precision, interpret)
    qr, kr = q_ref[...], k_ref[...]
    s0 = s0_ref[...].astype(F32)
    if _is_low(qr, kr):
        one = _one_pass("bf16", interpret)
        s_hi = s0.astype(BF16)
        s_lo = (s0 - s_hi.astype(F32)).astype(BF16)
        ks = dot(kr, s_hi, one) + dot(kr, s_lo, one)
        qs = dot(qr, s_hi, one) + dot(qr, s_lo, one)
    else:
        qf, kf = qr.astype(F32), kr.astype(F32)
        ks, qs = dot(kf, s0, x3), dot(qf, s0, x3)
    w = v_ref[...].astype(F32) - ck_ref[...][:, None] * ks
    u = dot(m_ref[...], w, x3)
    o = cq_ref[...][:, None] * qs + dot(p2_ref[...], u, x3)
    o_ref[...] = o.astype(o_ref.dtype)
    u_ref[...] = u


def _tree_operand(parents, ancestors, n: int, npad: int, blocks: SplitVerifyBlocks):
    """Kernel A's tree input (:func:`pallas_kernels.tree_verify.tree_input`) and its block
    spec on the (row, head) grid."""
    tree = tree_input(parents, ancestors, n, blocks.ancestors_input)
    if blocks.ancestors_input:
        return tree, pl.BlockSpec((None, npad, npad), lambda i, h: (i, 0, 0))
    return tree, pl.BlockSpec((None, npad), lambda i, h: (i, 0))


def _check_common(n: int, blocks) -> None:
    check_max_nodes(n, MAX_NODES, "Pallas tree_verify kernel")
    check_blocks(blocks, SplitVerifyBlocks)


def tree_verify_matrices(
    q,
    k,
    v,
    g,
    beta,
    parents,
    *,
    scale=None,
    use_qk_l2norm=False,
    blocks: SplitVerifyBlocks = DEFAULT_SPLIT_BLOCKS,
    ancestors=None,
    interpret=False,
) -> SplitMatrices:
    """Kernel A alone (``v`` only for the input checks). See :class:`SplitMatrices`."""
    b, n = k.shape[0], k.shape[1]
    hv = v.shape[2]
    _check_common(n, blocks)
    t = prepare_tree_launch(q, k, v, g, beta, parents, scale=scale, block_v=blocks.block_v)
    npad, dk, grp = t.npad, t.k.shape[3], t.grp
    tree, tree_spec = _tree_operand(t.parents, ancestors, n, npad, blocks)
    qk_spec = pl.BlockSpec((None, npad, None, dk), lambda i, h: (i, 0, h // grp, 0))
    gb_spec = pl.BlockSpec((None, npad, None), lambda i, h: (i, 0, h))
    nn_spec = pl.BlockSpec((None, None, npad, npad), lambda i, h: (i, h, 0, 0))
    row_spec = pl.BlockSpec((None, None, npad), lambda i, h: (i, h, 0))
    nn = jax.ShapeDtypeStruct((b, hv, npad, npad), F32)
    rows = jax.ShapeDtypeStruct((b, hv, npad), F32)
    kernel = functools.partial(
        _matrices_kernel,
        scale=t.scale,
        use_l2norm=use_qk_l2norm,
        blocks=blocks,
        interpret=interpret,
    )
    out = pl.pallas_call(
        kernel,
        grid=(b, hv),
        in_specs=[qk_spec, qk_spec, gb_spec, gb_spec, tree_spec],
        out_specs=[nn_spec, nn_spec, gb_spec, row_spec, row_spec],
        out_shape=[nn, nn, jax.ShapeDtypeStruct((b, npad, hv), F32), rows, rows],
        compiler_params=plt.CompilerParams(
            num_warps=blocks.num_warps_a, num_stages=blocks.num_stages
        ),
        interpret=interpret,
        name="gdn_tree_verify_split_matrices",
    )(t.q, t.k, t.g, t.beta, tree)
    return SplitMatrices(*out)


def tree_verify_apply(
    q,
    k,
    v,
    initial_state,
    mats: SplitMatrices,
    *,
    blocks: SplitVerifyBlocks = DEFAULT_SPLIT_BLOCKS,
    interpret=False,
) -> tuple[jax.Array, jax.Array]:
    """Kernel B alone: ``(o [B, N, Hv, V] in v's dtype, u f32 [B, N, Hv, V])`` from the
    :class:`SplitMatrices` of the same inputs."""
    b, n, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    npad = mats.m.shape[-1]
    grp, bv = hv // hk, min(blocks.block_v, dv)
    q, k, v = (pad_axis(x, 1, npad) for x in (q, k, v))
    qk_spec = pl.BlockSpec((None, npad, None, dk), lambda i, h, j: (i, 0, h // grp, 0))
    vo_spec = pl.BlockSpec((None, npad, None, bv), lambda i, h, j: (i, 0, h, j))
    s0_spec = pl.BlockSpec((None, None, dk, bv), lambda i, h, j: (i, h, 0, j))
    nn_spec = pl.BlockSpec((None, None, npad, npad), lambda i, h, j: (i, h, 0, 0))
    row_spec = pl.BlockSpec((None, None, npad), lambda i, h, j: (i, h, 0))
    o, u = pl.pallas_call(
        functools.partial(_apply_kernel, blocks=blocks, interpret=interpret),
        grid=(b, hv, dv // bv),
        in_specs=[qk_spec, qk_spec, vo_spec, s0_spec, nn_spec, nn_spec, row_spec, row_spec],
        out_specs=[vo_spec, vo_spec],
        out_shape=[
            jax.ShapeDtypeStruct((b, npad, hv, dv), v.dtype),
            jax.ShapeDtypeStruct((b, npad, hv, dv), F32),
        ],
        compiler_params=plt.CompilerParams(
            num_warps=blocks.num_warps_b, num_stages=blocks.num_stages
        ),
        interpret=interpret,
        name="gdn_tree_verify_split_apply",
    )(q, k, v, initial_state, mats.m, mats.p2, mats.ck, mats.cq)
    if npad != n:
        o, u = o[:, :n], u[:, :n]
    return o, u


def tree_verify_split(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    parents: jax.Array,
    initial_state: jax.Array,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    blocks: SplitVerifyBlocks = DEFAULT_SPLIT_BLOCKS,
    ancestors: jax.Array | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Tree WY verify in two kernels (module docstring); a drop-in for
    :func:`pallas_kernels.tree_verify` with :class:`SplitVerifyBlocks`.

    ``q, k [B, N, Hk, K]``, ``v [B, N, Hv, V]``, ``g, beta [B, N, Hv]``, ``parents`` int
    ``[B, N]``, ``initial_state`` f32 ``[B, Hv, K, V]``; ``ancestors`` (bool or int
    ``[B, N, N]``) only with ``blocks.ancestors_input``. Returns ``(o [B, N, Hv, V] in v's
    dtype, u f32 [B, N, Hv, V], g_path f32 [B, N, Hv])``.
    """
    mats = tree_verify_matrices(
        q,
        k,
        v,
        g,
        beta,
        parents,
        scale=scale,
        use_qk_l2norm=use_qk_l2norm,
        blocks=blocks,
        ancestors=ancestors,
        interpret=interpret,
    )
    o, u = tree_verify_apply(q, k, v, initial_state, mats, blocks=blocks, interpret=interpret)
    return o, u, mats.g_path[:, : k.shape[1]]
