"""Plain-JAX reference of the commit: the specification of ``kernel.py`` and ``arena.py``.

After a tree verify (``u``, ``g_path``: :func:`pallas_kernels.verify.reference.tree_verify_reference`)
the accepted chain ``path[:path_len]`` (root to leaf) is committed in closed form, per value
head ``h`` (key head ``h // (Hv // Hk)``)::

    S_new = exp(G_last) S0 + sum_{j < path_len} exp(G_last - G_j) k_j u_j^T

with ``j`` the path's nodes, ``G_j = g_path[path[j]]``, ``G_last = G_{path_len - 1}`` (0 for an
empty path, which leaves ``S0`` unchanged) and ``k`` l2-normalised when ``use_qk_l2norm`` (no
scale). This equals the state the recurrence reaches at the path's last node.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._reference import F32, HIGHEST, l2norm, read_states, value_heads, write_states


@functools.partial(jax.jit, static_argnames=("use_qk_l2norm",))
def tree_commit_reference(initial_state, k, u, g_path, path, path_len, *, use_qk_l2norm=False):
    """New state f32 ``[B, Hv, K, V]`` after ``path[b, :path_len[b]]`` (module docstring).

    ``initial_state [B, Hv, K, V]``, ``k [B, N, Hk, K]`` raw keys, ``u`` f32 ``[B, N, Hv, V]``,
    ``g_path`` f32 ``[B, N, Hv]``, ``path int [B, D]`` (entries past ``path_len`` ignored),
    ``path_len int [B]``; as :func:`pallas_kernels.commit.tree_commit`.
    """
    k = l2norm(k) if use_qk_l2norm else k.astype(F32)
    k = value_heads(k, u.shape[2], axis=2)

    def row(s0, k, u, g_path, path, path_len):
        on_path = jnp.arange(path.shape[0]) < path_len  # [D]
        nodes = jnp.where(on_path, path, 0)
        g = g_path[nodes]  # [D, Hv]
        g_last = jnp.where(path_len > 0, g[jnp.maximum(path_len - 1, 0)], 0.0)  # [Hv]
        w = jnp.where(on_path[:, None], jnp.exp(g_last - g), 0.0)  # [D, Hv]
        update = jnp.einsum("dh,dhk,dhv->hkv", w, k[nodes], u[nodes], precision=HIGHEST)
        return jnp.exp(g_last)[:, None, None] * s0 + update

    args = (u.astype(F32), g_path.astype(F32), path.astype(jnp.int32), path_len)
    return jax.vmap(row)(initial_state.astype(F32), k, *args)


@functools.partial(jax.jit, static_argnames=("state_offset", "use_qk_l2norm"))
def tree_commit_arena_reference(
    arena, table, handles, k, u, g_path, path, path_len, *, state_offset, use_qk_l2norm=False
):
    """:func:`tree_commit_reference` on the states in the ``uint32 [segments, words]`` arena:
    row ``b``'s f32 ``[Hv, K, V]`` state at word ``table[handles[b], 1] + state_offset`` of
    segment ``table[handles[b], 0]`` is replaced by its new state; rows with ``handles[b] < 0``
    (padding) write nothing. Returns the new arena, as
    :func:`pallas_kernels.commit.arena.tree_commit`."""
    shape = (u.shape[2], k.shape[3], u.shape[3])
    s0 = read_states(arena, table, handles, state_offset=state_offset, shape=shape)
    new = tree_commit_reference(s0, k, u, g_path, path, path_len, use_qk_l2norm=use_qk_l2norm)
    return write_states(arena, table, handles, new, state_offset=state_offset)
