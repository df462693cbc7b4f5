"""Tree verify and commit that read (and the commit writes) GDN states in a memory arena through
a handle table, in place: no gather of the states into a per-layer buffer (issue 5).

The arena is the serving memory manager's one ``uint32 [segments, segment_words]`` buffer; a
request's state unit is at ``table[handle] = (segment, word)``, and its layer's recurrent state
``f32 [Hv, K, V]`` starts ``state_offset`` words further (``serving.memory.model_cache.
ArenaSpec.state_offset + layer * Hv * K * V``). Each program translates its batch row's handle
through the table, loads its ``[K, block_v]`` tile of words with one indexed load and bitcasts
it to f32; the commit stores the new tile back the same way into the aliased (donated) arena.
A handle ``< 0`` (a padding row) reads a zero state and is never written.

The kernel bodies are those of :mod:`pallas_kernels.tree_verify` and
:mod:`pallas_kernels.tree_commit`; only where ``S0`` comes from (and where the commit's result
goes) differs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._wy import F32, prepare_tree_launch
from pallas_kernels.tree_commit import (
    DEFAULT_COMMIT_BLOCKS,
    CommitBlocks,
    prepare_commit_launch,
)
from pallas_kernels.tree_verify import (
    DEFAULT_VERIFY_BLOCKS,
    MAX_NODES,
    VerifyBlocks,
    _refine_kernel,
    verify_specs,
)


class _Value:
    """Stands in for a ref whose whole block is a value already in registers (``ref[...]``)."""

    def __init__(self, value=None):
        self.value = value

    def __getitem__(self, idx):
        assert idx is Ellipsis
        return self.value

    def __setitem__(self, idx, value):
        assert idx is Ellipsis
        self.value = value


def _tile_address(handles_ref, table_ref, *, offset: int, dk: int, dv: int, bv: int):
    """``(valid, segment, word index [dk, bv])`` of this program's state tile."""
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    handle = handles_ref[b]
    valid = handle >= 0
    handle = jnp.maximum(handle, 0)
    seg, word = table_ref[handle, 0], table_ref[handle, 1]
    base = word + offset + h * (dk * dv) + j * bv
    row = jax.lax.broadcasted_iota(jnp.int32, (dk, bv), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (dk, bv), 1)
    return valid, seg, base + row * dv + col


def _load_state(arena_ref, addr):
    valid, seg, idx = addr
    s0 = jax.lax.bitcast_convert_type(arena_ref[seg, idx], F32)
    return jnp.where(valid, s0, 0.0)


def _store_state(out_ref, addr, s):
    """Stores the f32 tile ``s`` as words at ``addr`` (from :func:`_tile_address`) of the
    aliased arena output, masked off for a padding row."""
    valid, seg, idx = addr
    words = jax.lax.bitcast_convert_type(s, jnp.uint32)
    plt.store(out_ref.at[seg, idx], words, mask=jnp.broadcast_to(valid, idx.shape))


def _check_arena(arena, table, handles, b, offset, hv, dk, dv):
    if arena.ndim != 2 or arena.dtype != jnp.uint32:
        raise ValueError(f"arena: expected uint32 [segments, words], got {arena.dtype} {arena.shape}")
    if table.ndim != 2 or table.shape[1] != 2 or not jnp.issubdtype(table.dtype, jnp.integer):
        raise ValueError(f"table: expected int [handles, 2], got {table.dtype} {table.shape}")
    if handles.shape != (b,) or not jnp.issubdtype(handles.dtype, jnp.integer):
        raise ValueError(f"handles: expected int [B] = ({b},), got {handles.dtype} {handles.shape}")
    if not 0 <= offset or offset + hv * dk * dv > arena.shape[1]:
        raise ValueError(
            f"state_offset: {offset} + Hv*K*V = {hv * dk * dv} words must fit a segment of "
            f"{arena.shape[1]} words")


def _whole():
    return pl.BlockSpec(memory_space=None)


def tree_verify(
    q, k, v, g, beta, parents, arena, table, handles, *, state_offset: int,
    scale: float | None = None, use_qk_l2norm: bool = False,
    blocks: VerifyBlocks = DEFAULT_VERIFY_BLOCKS, interpret: bool = False,
):  # fmt: skip
    """:func:`pallas_kernels.tree_verify` with ``S0[b]`` read from the arena: the f32
    ``[Hv, K, V]`` state at word ``table[handles[b], 1] + state_offset`` of segment
    ``table[handles[b], 0]``. Returns ``(o, u, g_path)``."""
    b, n = k.shape[:2]
    hv, dk, dv = v.shape[2], k.shape[3], v.shape[3]
    if blocks.mode != "refine" or blocks.ancestors_input:
        raise ValueError("blocks: the arena verify runs the 'refine' kernel on parent ids")
    if n > MAX_NODES:
        raise ValueError(f"N: the arena verify supports at most {MAX_NODES} nodes, got {n}")
    _check_arena(arena, table, handles, b, state_offset, hv, dk, dv)
    t = prepare_tree_launch(q, k, v, g, beta, parents, scale=scale, block_v=blocks.block_v)
    q, k, v, g, beta, parents = t[:6]
    npad, bv = t.npad, t.bv
    body = functools.partial(
        _refine_kernel, scale=t.scale, use_l2norm=use_qk_l2norm, blocks=blocks,
        interpret=interpret)  # fmt: skip

    def kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, par_ref, hd_ref, tab_ref, ar_ref,
               o_ref, u_ref, gp_ref):  # fmt: skip
        addr = _tile_address(hd_ref, tab_ref, offset=state_offset, dk=dk, dv=dv, bv=bv)
        s0 = _Value(_load_state(ar_ref, addr))
        body(q_ref, k_ref, v_ref, g_ref, beta_ref, par_ref, s0, o_ref, u_ref, gp_ref)

    in_specs, out_specs, out_shape = verify_specs(t, v)
    o, u, g_path = pl.pallas_call(
        kernel,
        grid=(b, hv, dv // bv),
        in_specs=[*in_specs, pl.BlockSpec((None, npad), lambda i, h, j: (i, 0)),
                  _whole(), _whole(), _whole()],  # fmt: skip
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(
            num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name="gdn_tree_verify_arena",
    )(q, k, v, g, beta, parents, handles.astype(jnp.int32), table.astype(jnp.int32), arena)
    if npad != n:
        o, u, g_path = o[:, :n], u[:, :n], g_path[:, :n]
    return o, u, g_path


def tree_commit(
    arena, table, handles, k, u, g_path, path, path_len, *, state_offset: int,
    use_qk_l2norm: bool = False, blocks: CommitBlocks = DEFAULT_COMMIT_BLOCKS,
    interpret: bool = False,
):  # fmt: skip
    """:func:`pallas_kernels.tree_commit` on the states in the arena, written in place: the
    returned arena is ``arena`` (aliased; donate it) with each valid row's state replaced."""
    t = prepare_commit_launch(
        k, u, g_path, path, path_len, blocks, use_qk_l2norm=use_qk_l2norm, interpret=interpret)
    b, hv, dk, dv, bv = t.grid[0], t.grid[1], k.shape[3], u.shape[3], t.bv
    _check_arena(arena, table, handles, b, state_offset, hv, dk, dv)

    def kernel(k_ref, u_ref, gp_ref, path_ref, hd_ref, tab_ref, ar_ref, out_ref):
        ok, seg, idx = _tile_address(hd_ref, tab_ref, offset=state_offset, dk=dk, dv=dv, bv=bv)
        new = _Value()
        t.body(_Value(_load_state(ar_ref, (ok, seg, idx))), k_ref, u_ref, gp_ref, path_ref, new)
        words = jax.lax.bitcast_convert_type(new.value, jnp.uint32)
        plt.store(out_ref.at[seg, idx], words, mask=jnp.broadcast_to(ok, idx.shape))

    return pl.pallas_call(
        kernel,
        grid=t.grid,
        in_specs=[*t.in_specs, _whole(), _whole(), _whole()],
        out_specs=_whole(),
        out_shape=jax.ShapeDtypeStruct(arena.shape, arena.dtype),
        input_output_aliases={6: 0},
        compiler_params=plt.CompilerParams(
            num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name="gdn_tree_commit_arena",
    )(*t.args, handles.astype(jnp.int32), table.astype(jnp.int32), arena)
