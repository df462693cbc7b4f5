"""Snapshot verification of a draft tree (the vLLM/SGLang method), as a fused Pallas kernel.

The benchmark baseline for tree WY: node ``n`` (topological order) reloads its parent's full
state from HBM (``S0`` above a root), applies one recurrence step (docs/design.md) and
writes its own state::

    S = exp(g_n) S_parent;  u = beta_n (v_n - S^T k_n);  S_n = S + k_n u^T;  o_n = S_n^T q_n

One program per (batch row, value head, block of value columns): columns of ``S`` are independent,
so the split keeps the GPU full without changing the bytes moved.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._wy import F32, prep_rows, prepare_tree_launch


@dataclasses.dataclass(frozen=True)
class SnapshotBlocks:
    """Static knobs: value columns per program and Triton warps/stages."""

    block_v: int = 32
    num_warps: int = 4
    num_stages: int = 1


def _kernel(
    q_ref,
    k_ref,
    v_ref,
    g_ref,
    beta_ref,
    par_ref,
    s0_ref,
    o_ref,
    snap_ref,
    *,
    n_nodes,
    scale,
    use_l2norm,
    interpret,
):
    s0 = s0_ref[...].astype(F32)

    def step(i, carry):
        p = par_ref[i]
        has_parent = jnp.full(s0.shape, p >= 0)
        s_par = plt.load(snap_ref.at[jnp.maximum(p, 0)], mask=has_parent, other=0.0)
        s = jnp.where(has_parent, s_par, s0) * jnp.exp(g_ref[i].astype(F32))
        k = prep_rows(k_ref[pl.ds(i, 1), :], use_l2norm)  # [1, K]
        q = prep_rows(q_ref[pl.ds(i, 1), :], use_l2norm, scale)
        ks = jnp.sum(jnp.transpose(k) * s, axis=0, keepdims=True)  # [1, Vb]
        u = beta_ref[i].astype(F32) * (v_ref[pl.ds(i, 1), :].astype(F32) - ks)
        s = s + jnp.transpose(k) * u
        o_ref[pl.ds(i, 1), :] = jnp.sum(jnp.transpose(q) * s, axis=0, keepdims=True).astype(
            o_ref.dtype
        )
        snap_ref[i] = s
        if not interpret:
            plt.debug_barrier()  # the next node may read this state through other threads
        return carry

    jax.lax.fori_loop(0, n_nodes, step, 0)


def snapshot_verify(
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
    blocks: SnapshotBlocks = SnapshotBlocks(),
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Per-node outputs and states. Shapes as :func:`pallas_kernels.tree_verify`.

    Returns ``(o [B, N, Hv, V] in v's dtype, snapshots f32 [B, N, Hv, K, V])``.
    """
    b, n, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    t = prepare_tree_launch(q, k, v, g, beta, parents, scale=scale, block_v=blocks.block_v)
    q, k, v, g, beta, parents = t[:6]
    npad, bv, grp, scale = t.npad, t.bv, t.grp, t.scale
    kernel = functools.partial(
        _kernel, n_nodes=n, scale=scale, use_l2norm=use_qk_l2norm, interpret=interpret
    )
    qk_spec = pl.BlockSpec((None, npad, None, dk), lambda i, h, j: (i, 0, h // grp, 0))
    vo_spec = pl.BlockSpec((None, npad, None, bv), lambda i, h, j: (i, 0, h, j))
    gb_spec = pl.BlockSpec((None, npad, None), lambda i, h, j: (i, 0, h))
    o, snaps = pl.pallas_call(
        kernel,
        grid=(b, hv, dv // bv),
        in_specs=[
            qk_spec,
            qk_spec,
            vo_spec,
            gb_spec,
            gb_spec,
            pl.BlockSpec((None, npad), lambda i, h, j: (i, 0)),
            pl.BlockSpec((None, None, dk, bv), lambda i, h, j: (i, h, 0, j)),
        ],
        out_specs=[
            vo_spec,
            pl.BlockSpec((None, npad, None, dk, bv), lambda i, h, j: (i, 0, h, 0, j)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, npad, hv, dv), v.dtype),
            jax.ShapeDtypeStruct((b, npad, hv, dk, dv), F32),
        ],
        compiler_params=plt.CompilerParams(
            num_warps=blocks.num_warps, num_stages=blocks.num_stages
        ),
        interpret=interpret,
        name="gdn_snapshot_verify",
    )(q, k, v, g, beta, parents, initial_state)
    if npad != n:
        o, snaps = o[:, :n], snaps[:, :n]
    return o, snaps
