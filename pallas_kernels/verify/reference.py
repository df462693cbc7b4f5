"""Plain-JAX reference of the tree verify: the specification of ``kernel.py``, ``arena.py`` and
``snapshot.py`` (and of ``experimental/verify_split.py``).

A draft tree lists its nodes in topological order: ``parents[n] < n``, ``-1`` for a child of the
committed state ``S0``, ``-2`` for a padding node. Node ``n`` is decoded from ``S0`` along its
own root-to-node path, one token at a time, with its parent's state ``S_p`` (``S0`` above a
root)::

    S = exp(g_n) S_p;   u_n = beta_n (v_n - S^T k_n);   S_n = S + k_n u_n^T;   o_n = S_n^T q_n
    g_path_n = g_n + g_path_p   (0 above a root)

per value head ``h`` (key head ``h // (Hv // Hk)``), after the optional l2norm of ``q`` and
``k`` and ``q *= scale`` (default ``K ** -0.5``). The tree WY kernels compute the same ``o``,
``u`` and ``g_path`` in closed form. Padding nodes are decoded as roots here; their outputs
are unspecified (the kernels only keep them finite).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._reference import F32, delta_step, prepare_qk, read_states, value_heads


def _tree_scan(q, k, v, g, beta, parents, initial_state, scale, use_qk_l2norm):
    """``(o, u [B, N, Hv, V], g_path [B, N, Hv], states [B, N, Hv, K, V])``, all f32, by a loop
    over the nodes that starts each one from its parent's state."""
    hv = v.shape[2]
    q, k = prepare_qk(q, k, scale, use_qk_l2norm)
    q, k = value_heads(q, hv, axis=2), value_heads(k, hv, axis=2)

    def row(q, k, v, g, beta, parents, s0):
        n, dv = v.shape[0], v.shape[2]

        def node(i, carry):
            states, o, u, g_path = carry
            p = parents[i]
            root, pi = p < 0, jnp.maximum(p, 0)
            s_parent = jnp.where(root, s0, states[pi])
            g_parent = jnp.where(root, 0.0, g_path[pi])
            s, o_i, u_i = delta_step(s_parent, q[i], k[i], v[i], g[i], beta[i])
            return (
                states.at[i].set(s),
                o.at[i].set(o_i),
                u.at[i].set(u_i),
                g_path.at[i].set(g_parent + g[i]),
            )

        zeros = (jnp.zeros((n, *s0.shape), F32), jnp.zeros((n, hv, dv), F32))
        init = (*zeros, zeros[1], jnp.zeros((n, hv), F32))
        states, o, u, g_path = jax.lax.fori_loop(0, n, node, init)
        return o, u, g_path, states

    args = (v.astype(F32), g.astype(F32), beta.astype(F32), parents.astype(jnp.int32))
    return jax.vmap(row)(q, k, *args, initial_state.astype(F32))


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm"))
def tree_verify_reference(
    q, k, v, g, beta, parents, initial_state, *, scale=None, use_qk_l2norm=False
):
    """Tree verify by the per-node recurrence (module docstring).

    ``q, k [B, N, Hk, K]``, ``v [B, N, Hv, V]``, ``g, beta [B, N, Hv]``, ``parents int [B, N]``,
    ``initial_state [B, Hv, K, V]``. Returns ``(o [B, N, Hv, V] in v's dtype, u f32
    [B, N, Hv, V], g_path f32 [B, N, Hv])``, as :func:`pallas_kernels.verify.tree_verify`.
    """
    o, u, g_path, _ = _tree_scan(q, k, v, g, beta, parents, initial_state, scale, use_qk_l2norm)
    return o.astype(v.dtype), u, g_path


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm"))
def snapshot_verify_reference(
    q, k, v, g, beta, parents, initial_state, *, scale=None, use_qk_l2norm=False
):
    """Per-node outputs and states (shapes as :func:`tree_verify_reference`). Returns
    ``(o [B, N, Hv, V] in v's dtype, states f32 [B, N, Hv, K, V])``, as
    :func:`pallas_kernels.verify.snapshot_verify`: ``states[:, n]`` is ``S_n``."""
    o, _, _, states = _tree_scan(q, k, v, g, beta, parents, initial_state, scale, use_qk_l2norm)
    return o.astype(v.dtype), states


@functools.partial(jax.jit, static_argnames=("state_offset", "scale", "use_qk_l2norm"))
def tree_verify_arena_reference(
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
    state_offset,
    scale=None,
    use_qk_l2norm=False,
):
    """:func:`tree_verify_reference` with ``S0[b]`` the f32 ``[Hv, K, V]`` state at word
    ``table[handles[b], 1] + state_offset`` of segment ``table[handles[b], 0]`` of the
    ``uint32 [segments, words]`` arena (a zero state where ``handles[b] < 0``), as
    :func:`pallas_kernels.verify.arena.tree_verify`."""
    shape = (v.shape[2], k.shape[3], v.shape[3])
    s0 = read_states(arena, table, handles, state_offset=state_offset, shape=shape)
    return tree_verify_reference(
        q, k, v, g, beta, parents, s0, scale=scale, use_qk_l2norm=use_qk_l2norm
    )
