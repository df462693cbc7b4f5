"""Commit of an accepted chain of a verified draft tree as a Mosaic TPU kernel (docs/design.md,
"Commit of an accepted chain"), in place::

    S_new = exp(G_last) S0 + K^T (c * U),   c_n = exp(G_last - G_n) if n on the path else 0

One program per (batch row, value head); the state block is aliased to the output, so a
donated state is updated in place. The path ids and lengths are scalar-prefetched into SMEM:
the kernel marks the path's nodes on a row of ``Npad`` lanes and reads all ``Npad`` rows of the
head's ``K`` and ``U`` (a masked read: ``Npad x V`` floats of ``U`` next to the ``2 K V`` of
the state), so no row gather is needed. bf16 keys enter the ``K^T (c U)`` dot raw (exact
products) against the two bf16 halves of ``c U``; f32 keys take ``precision``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._wy import (
    F32,
    check_float,
    check_grouped_heads,
    check_max_nodes,
    mask_path,
    masked_decay,
    next_pow2,
    pad_axis,
)
from pallas_kernels.tpu._arena import (
    any_spec,
    check_arena,
    lane_rows,
    load_states,
    state_rows,
    store_states,
)
from pallas_kernels.tpu._common import (
    check_head_dim,
    check_precision,
    compiler_params,
    dot,
    head_major,
    interpret_params,
    iota,
    row_scales,
    to_col,
    vmem_bytes,
)
from pallas_kernels.tpu.verify import MAX_NODES


@dataclasses.dataclass(frozen=True)
class TpuCommitBlocks:
    """Static knobs of the TPU commit: ``precision`` of the ``K^T (c U)`` dot (``"bf16x3"`` or
    ``"bf16x6"``; :mod:`pallas_kernels.tpu._common`)."""

    precision: str = "bf16x3"

    def __post_init__(self):
        check_precision("blocks.precision", self.precision)
        if self.precision == "bf16":
            raise ValueError("blocks.precision: 'bf16x3' or 'bf16x6'")


DEFAULT_TPU_COMMIT_BLOCKS = TpuCommitBlocks()


def commit_math(path_ref, len_ref, b, s0, k, u, gp_row, *, use_l2norm, precision):
    """The new f32 state ``(K, V)`` of one head: ``s0 (K, V)``, raw ``k (Npad, K)``, ``u
    (Npad, V)``, ``gp_row (1, Npad)``; row ``b``'s path ids and length from the SMEM refs."""
    npad = gp_row.shape[1]
    plen = len_ref[b]
    col = iota((1, npad), 1)

    def mark(d, on):
        return jnp.where(col == path_ref[b, d], 1, on)

    on = jax.lax.fori_loop(0, plen, mark, jnp.zeros((1, npad), jnp.int32)) > 0
    last = path_ref[b, jnp.maximum(plen - 1, 0)]
    g_last = jnp.sum(jnp.where(col == last, gp_row, 0.0), axis=1, keepdims=True)  # (1, 1)
    g_last = jnp.where(plen > 0, g_last, 0.0)
    c = to_col(masked_decay(g_last, gp_row, on)) * row_scales(k, use_l2norm)  # (Npad, 1)
    upd = dot(k, c * u, precision, trans_a=True)
    return jnp.exp(g_last) * s0 + upd


def _kernel(path_ref, len_ref, s0_ref, k_ref, u_ref, gp_ref, out_ref, *, use_l2norm, precision):
    out_ref[...] = commit_math(
        path_ref,
        len_ref,
        pl.program_id(0),
        s0_ref[...],
        k_ref[...],
        u_ref[...],
        gp_ref[...],
        use_l2norm=use_l2norm,
        precision=precision,
    )


@dataclasses.dataclass(frozen=True)
class CommitLaunch:
    """Head-major, padded commit operands: ``k [B, Hk, Npad, K]``, ``u [B, Hv, Npad, V]``,
    ``gp [B, Hv, 1, Npad]``, ``path`` int32 ``[B, Dpad]`` (-1 past the length), ``plen [B]``."""

    k: jax.Array
    u: jax.Array
    gp: jax.Array
    path: jax.Array
    plen: jax.Array
    npad: int
    grp: int


def prepare_commit(k, u, g_path, path, path_len) -> CommitLaunch:
    """Checks the commit inputs (ValueError naming the limit) and lays them out head-major with
    ``N`` padded to a power of two >= 16."""
    b, n, hk, dk = k.shape
    hv, dv = u.shape[2], u.shape[3]
    check_max_nodes(n, MAX_NODES, "TPU tree_commit kernel")
    check_grouped_heads(hk, hv, "u")
    check_head_dim("K", dk)
    check_head_dim("V", dv)
    check_float("k", k, "TPU")
    npad = next_pow2(n, 16)
    k, u, g_path = (pad_axis(x, 1, npad) for x in (k, u, g_path))
    path = mask_path(path, path_len, max(path.shape[1], 1))
    gp = head_major(g_path.astype(F32))[:, :, None, :]
    return CommitLaunch(
        head_major(k),
        head_major(u.astype(F32)),
        gp,
        path,
        path_len.astype(jnp.int32),
        npad=npad,
        grp=hv // hk,
    )


def commit_specs(t: CommitLaunch, dk: int, dv: int):
    """Block specs of ``k, u, gp`` on the ``(row, value head)`` grid of a scalar-prefetch call
    (index maps take the two prefetched refs)."""
    grp, npad = t.grp, t.npad
    return [
        pl.BlockSpec((None, None, npad, dk), lambda i, h, *_: (i, h // grp, 0, 0)),
        pl.BlockSpec((None, None, npad, dv), lambda i, h, *_: (i, h, 0, 0)),
        pl.BlockSpec((None, None, 1, npad), lambda i, h, *_: (i, h, 0, 0)),
    ]


def commit_vmem(t: CommitLaunch, dk: int, dv: int, k_dtype) -> int:
    """VMEM of one program: the state in and out, ``k``, ``U`` and ``G`` blocks (double
    buffered) and about four ``(Npad, V)`` and two ``(Npad, Npad)`` f32 temporaries."""
    npad = t.npad
    blocks = [
        ((dk, dv), F32),
        ((npad, dk), k_dtype),
        ((npad, dv), F32),
        ((1, npad), F32),
        ((dk, dv), F32),
    ]
    temps = [((npad, dv), F32)] * 4 + [((npad, npad), F32)] * 2 + [((dk, dv), F32)] * 2
    return vmem_bytes(blocks, temporaries=temps)


@functools.partial(jax.jit, static_argnames=("use_qk_l2norm", "blocks", "interpret"))
def tree_commit(
    initial_state: jax.Array,
    k: jax.Array,
    u: jax.Array,
    g_path: jax.Array,
    path: jax.Array,
    path_len: jax.Array,
    *,
    use_qk_l2norm: bool = False,
    blocks: TpuCommitBlocks = DEFAULT_TPU_COMMIT_BLOCKS,
    interpret: bool = False,
) -> jax.Array:
    """New state f32 ``[B, Hv, K, V]`` after ``path[b, :path_len[b]]`` (root to leaf), as
    :func:`pallas_kernels.tree_commit`: ``k [B, N, Hk, K]`` raw keys, ``u`` f32 ``[B, N, Hv,
    V]``, ``g_path`` f32 ``[B, N, Hv]``, ``path`` int ``[B, D]``, ``path_len [B]``.
    ``initial_state`` is aliased to the result: donate it to update in place."""
    t = prepare_commit(k, u, g_path, path, path_len)
    b, hv, dk, dv = initial_state.shape
    s_spec = pl.BlockSpec((None, None, dk, dv), lambda i, h, *_: (i, h, 0, 0))
    kernel = functools.partial(_kernel, use_l2norm=use_qk_l2norm, precision=blocks.precision)
    need = commit_vmem(t, dk, dv, k.dtype)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, hv),
            in_specs=[s_spec, *commit_specs(t, dk, dv)],
            out_specs=s_spec,
        ),
        out_shape=jax.ShapeDtypeStruct((b, hv, dk, dv), F32),
        input_output_aliases={2: 0},
        compiler_params=compiler_params("tree_commit", need, ("parallel", "parallel")),
        interpret=interpret_params(interpret),
        name="gdn_tree_commit_tpu",
    )(t.path, t.plen, initial_state.astype(F32), t.k, t.u, t.gp)


@functools.partial(
    jax.jit, static_argnames=("state_offset", "use_qk_l2norm", "blocks", "interpret")
)
def tree_commit_arena(
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
    blocks: TpuCommitBlocks = DEFAULT_TPU_COMMIT_BLOCKS,
    interpret: bool = False,
):
    """:func:`tree_commit` on the states in the serving memory arena, written in place
    (:mod:`pallas_kernels.tpu._arena`: ``V == 128``, states on 128-word rows): the returned
    arena (same shape as ``arena``; aliased, donate it) has each valid row's state replaced."""
    b, n, hk, dk = k.shape
    hv, dv = u.shape[2], u.shape[3]
    check_arena(arena, table, handles, b, state_offset, hv, dk, dv)
    t = prepare_commit(k, u, g_path, path, path_len)

    def kernel(path_ref, len_ref, hd_ref, tab_ref, k_ref, u_ref, gp_ref, ar_ref, out_ref, buf):
        i, h = pl.program_id(0), pl.program_id(1)
        addr = state_rows(hd_ref, tab_ref, i, offset=state_offset, first_row=h * dk)
        s0 = load_states(ar_ref, buf, addr, (1, dk, dv))[0]
        new = commit_math(
            path_ref,
            len_ref,
            i,
            s0,
            k_ref[...],
            u_ref[...],
            gp_ref[...],
            use_l2norm=use_qk_l2norm,
            precision=blocks.precision,
        )
        store_states(out_ref, buf, addr, new)

    rows = lane_rows(arena)
    need = commit_vmem(t, dk, dv, k.dtype)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(b, hv),
            in_specs=[*commit_specs(t, dk, dv), any_spec()],
            out_specs=any_spec(),
            scratch_shapes=[pltpu.VMEM((dk, dv), jnp.uint32)],
        ),
        out_shape=jax.ShapeDtypeStruct(rows.shape, rows.dtype),
        input_output_aliases={7: 0},
        compiler_params=compiler_params("tree_commit_arena", need, ("parallel", "parallel")),
        interpret=interpret_params(interpret),
        name="gdn_tree_commit_arena_tpu",
    )(t.path, t.plen, handles.astype(jnp.int32), table.astype(jnp.int32), t.k, t.u, t.gp, rows)
    return out.reshape(arena.shape)
