"""Tree commit on the states in the serving memory arena, written back in place.

The kernel body is the dense commit's (:mod:`pallas_kernels.commit.kernel`); row ``b``'s f32
state ``[Hv, K, V]`` is read through the handle table (:mod:`pallas_kernels._arena`) and the
new state stored at the same words of the aliased (donated) arena.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._arena import Value, check_arena, load_state, store_state, tile_address, whole
from pallas_kernels.commit.kernel import (
    DEFAULT_COMMIT_BLOCKS,
    CommitBlocks,
    prepare_commit_launch,
)


def tree_commit(
    arena,
    table,
    handles,
    k,
    u,
    g_path,
    path,
    path_len,
    *,
    state_offset: int,
    use_qk_l2norm: bool = False,
    blocks: CommitBlocks = DEFAULT_COMMIT_BLOCKS,
    interpret: bool = False,
):
    """:func:`pallas_kernels.commit.tree_commit` on the states in the arena, written in place: the
    returned arena is ``arena`` (aliased; donate it) with each valid row's state replaced."""
    t = prepare_commit_launch(
        k, u, g_path, path, path_len, blocks, use_qk_l2norm=use_qk_l2norm, interpret=interpret
    )
    b, hv, dk, dv, bv = t.grid[0], t.grid[1], k.shape[3], u.shape[3], t.bv
    check_arena(arena, table, handles, b, state_offset, hv, dk, dv)

    def kernel(k_ref, u_ref, gp_ref, path_ref, hd_ref, tab_ref, ar_ref, out_ref):
        addr = tile_address(hd_ref, tab_ref, offset=state_offset, dk=dk, dv=dv, bv=bv)
        new = Value()
        t.body(Value(load_state(ar_ref, addr)), k_ref, u_ref, gp_ref, path_ref, new)
        store_state(out_ref, addr, new.value)

    return pl.pallas_call(
        kernel,
        grid=t.grid,
        in_specs=[*t.in_specs, whole(), whole(), whole()],
        out_specs=whole(),
        out_shape=jax.ShapeDtypeStruct(arena.shape, arena.dtype),
        input_output_aliases={6: 0},
        compiler_params=plt.CompilerParams(
            num_warps=blocks.num_warps, num_stages=blocks.num_stages
        ),
        interpret=interpret,
        name="gdn_tree_commit_arena",
    )(*t.args, handles.astype(jnp.int32), table.astype(jnp.int32), arena)
