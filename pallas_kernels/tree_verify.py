"""Tree WY verification of a draft tree through one GDN layer (DESIGN.md section 3), fused.

One program per (batch row, value head, block of value columns). With the inclusive ancestor
mask ``P`` built in-kernel from the parent ids::

    G = P g;  A[n, i] = beta_n exp(G_n - G_i) (k_n . k_i), i in anc(n)
    U = (I + A)^-1 diag(beta) (V - diag(e^G) K S0)
    O = diag(e^G) Q S0 + ((Q K^T) * D) U

``S0`` is read from HBM once; ``K K^T`` and the inverse are recomputed per column block (cheap at
``N <= 128``). Grouped heads read key head ``h // (Hv // Hk)`` through the index map.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._wy import (
    DEFAULT_BLOCKS,
    F32,
    DotBlocks,
    ancestor_closure,
    dot_precision,
    masked_decay,
    prep_rows,
    prepare_tree_launch,
    wy_block,
)

MAX_NODES = 128
# On the H200 the Triton build for a 128-node tile asks for 320 KiB of shared memory (the limit is
# 227 KiB per block); interpret mode has no such limit.
GPU_MAX_NODES = 64


VerifyBlocks = DotBlocks


def _kernel(
    q_ref, k_ref, v_ref, g_ref, beta_ref, par_ref, s0_ref, o_ref, u_ref, gp_ref,
    *, scale, use_l2norm, precision,
):  # fmt: skip
    q = prep_rows(q_ref[...], use_l2norm, scale)
    k = prep_rows(k_ref[...], use_l2norm)
    incl = ancestor_closure(par_ref[...])
    n = incl.shape[0]
    strict = incl & (
        jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)
        != jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)
    )
    g_path = jnp.sum(jnp.where(incl, g_ref[...].astype(F32)[None, :], 0.0), axis=1)
    decay = masked_decay(g_path[:, None], g_path[None, :], incl)
    o, u = wy_block(
        q, k, v_ref[...].astype(F32), beta_ref[...].astype(F32), g_path, decay, strict,
        s0_ref[...].astype(F32), precision,
    )  # fmt: skip
    o_ref[...] = o.astype(o_ref.dtype)
    u_ref[...] = u
    gp_ref[...] = g_path


def tree_verify(
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
    blocks: VerifyBlocks = DEFAULT_BLOCKS,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Tree WY verify. ``q, k [B, N, Hk, K]``, ``v [B, N, Hv, V]``, ``g, beta [B, N, Hv]``,
    ``parents`` int ``[B, N]``, ``initial_state [B, Hv, K, V]``.

    Returns ``(o [B, N, Hv, V] in v's dtype, u f32 [B, N, Hv, V], g_path f32 [B, N, Hv])``.
    ``N`` is padded to a power of two >= 16 (padding nodes have parent -2 and zero inputs).
    """
    b, n, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    if n > MAX_NODES:
        raise ValueError(
            f"N: the Pallas tree_verify kernel supports at most {MAX_NODES} nodes, got {n}"
        )
    if not interpret and n > GPU_MAX_NODES:
        raise ValueError(
            f"N: on GPU the Pallas tree_verify kernel supports at most {GPU_MAX_NODES} nodes "
            f"(a 128-node tile exceeds the 227 KiB shared memory per block), got {n}; "
            "use the XLA path for larger trees"
        )
    t = prepare_tree_launch(q, k, v, g, beta, parents, scale=scale, block_v=blocks.block_v)
    q, k, v, g, beta, parents = t[:6]
    npad, bv, grp, scale = t.npad, t.bv, t.grp, t.scale

    kernel = functools.partial(
        _kernel,
        scale=scale,
        use_l2norm=use_qk_l2norm,
        precision=dot_precision(blocks.precision, interpret),
    )
    qk_spec = pl.BlockSpec((None, npad, None, dk), lambda i, h, j: (i, 0, h // grp, 0))
    vo_spec = pl.BlockSpec((None, npad, None, bv), lambda i, h, j: (i, 0, h, j))
    gb_spec = pl.BlockSpec((None, npad, None), lambda i, h, j: (i, 0, h))
    o, u, g_path = pl.pallas_call(
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
        out_specs=[vo_spec, vo_spec, gb_spec],
        out_shape=[
            jax.ShapeDtypeStruct((b, npad, hv, dv), v.dtype),
            jax.ShapeDtypeStruct((b, npad, hv, dv), F32),
            jax.ShapeDtypeStruct((b, npad, hv), F32),
        ],
        compiler_params=plt.CompilerParams(
            num_warps=blocks.num_warps, num_stages=blocks.num_stages
        ),
        interpret=interpret,
        name="gdn_tree_verify",
    )(q, k, v, g, beta, parents, initial_state)
    if npad != n:
        o, u, g_path = o[:, :n], u[:, :n], g_path[:, :n]
    return o, u, g_path
