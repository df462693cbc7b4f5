"""Tree WY verify with the initial states read in place from the serving memory arena.

The kernel body is the dense verify's ``"refine"`` kernel (:mod:`pallas_kernels.verify.kernel`);
only where ``S0`` comes from differs: row ``b``'s f32 state ``[Hv, K, V]`` is read through the
handle table (:mod:`pallas_kernels._arena`), so no per-layer gather of the states is needed.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._arena import Value, check_arena, load_state, tile_address, whole
from pallas_kernels._wy import check_max_nodes, prepare_tree_launch
from pallas_kernels.verify.kernel import (
    DEFAULT_VERIFY_BLOCKS,
    MAX_NODES,
    VerifyBlocks,
    check_gpu_limits,
    refine_kernel,
    verify_specs,
)


def tree_verify(
    q,
    k,
    v,
    g,
    beta,
    parents,
    arena,
    table,
    handles,
    *,
    state_offset: int,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    blocks: VerifyBlocks = DEFAULT_VERIFY_BLOCKS,
    interpret: bool = False,
):
    """:func:`pallas_kernels.verify.tree_verify` with ``S0[b]`` read from the arena: the f32
    ``[Hv, K, V]`` state at word ``table[handles[b], 1] + state_offset`` of segment
    ``table[handles[b], 0]``. Returns ``(o, u, g_path)``; the dense kernel's GPU limits apply
    (same build, same shared memory)."""
    b, n = k.shape[:2]
    hv, dk, dv = v.shape[2], k.shape[3], v.shape[3]
    if blocks.mode != "refine" or blocks.ancestors_input:
        raise ValueError("blocks: the arena verify runs the 'refine' kernel on parent ids")
    check_max_nodes(n, MAX_NODES, "arena verify")
    check_arena(arena, table, handles, b, state_offset, hv, dk, dv)
    t = prepare_tree_launch(q, k, v, g, beta, parents, scale=scale, block_v=blocks.block_v)
    if not interpret:
        check_gpu_limits(blocks, n, dk, dv, q.dtype, k.dtype)
    q, k, v, g, beta, parents = t[:6]
    npad, bv = t.npad, t.bv
    body = functools.partial(
        refine_kernel, scale=t.scale, use_l2norm=use_qk_l2norm, blocks=blocks, interpret=interpret
    )

    def kernel(
        q_ref, k_ref, v_ref, g_ref, beta_ref, par_ref, hd_ref, tab_ref, ar_ref, o_ref, u_ref, gp_ref
    ):
        addr = tile_address(hd_ref, tab_ref, offset=state_offset, dk=dk, dv=dv, bv=bv)
        s0 = Value(load_state(ar_ref, addr))
        body(q_ref, k_ref, v_ref, g_ref, beta_ref, par_ref, s0, o_ref, u_ref, gp_ref)

    in_specs, out_specs, out_shape = verify_specs(t, v)
    parents_spec = pl.BlockSpec((None, npad), lambda i, h, j: (i, 0))
    o, u, g_path = pl.pallas_call(
        kernel,
        grid=(b, hv, dv // bv),
        in_specs=[*in_specs, parents_spec, whole(), whole(), whole()],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(
            num_warps=blocks.num_warps, num_stages=blocks.num_stages
        ),
        interpret=interpret,
        name="gdn_tree_verify_arena",
    )(q, k, v, g, beta, parents, handles.astype(jnp.int32), table.astype(jnp.int32), arena)
    if npad != n:
        o, u, g_path = o[:, :n], u[:, :n], g_path[:, :n]
    return o, u, g_path
