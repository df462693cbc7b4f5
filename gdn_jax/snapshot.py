"""Snapshot verification of a draft tree: the vLLM/SGLang method, kept as the baseline.

Every node ``n`` loads its parent's full state (``S0`` above a root), applies one recurrence step
and stores its own ``[Hv, K, V]`` state: ``N`` snapshots per layer where tree WY keeps ``U``.
Commit is then a copy of the accepted leaf's snapshot. ``impl="auto"`` runs the fused Pallas
kernel (:func:`pallas_kernels.snapshot_verify`) on a GPU, the XLA loop below elsewhere.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from gdn_jax._prep import (
    HIGHEST,
    as_arrays,
    check_rule_inputs,
    group_heads,
    prepare_qk,
    ungroup_heads,
)
from gdn_jax.dispatch import pallas_op, resolve_impl
from gdn_jax.tree_wy import _check_parents


def snapshot_tree_verify(
    q: Float[Array, "B N Hk K"],
    k: Float[Array, "B N Hk K"],
    v: Float[Array, "B N Hv V"],
    g: Float[Array, "B N Hv"],
    beta: Float[Array, "B N Hv"],
    parents: Int[Array, "B N"],
    initial_state: Float[Array, "B Hv K V"],
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    impl: str = "auto",
) -> tuple[Float[Array, "B N Hv V"], Float[Array, "B N Hv K V"]]:
    """Per-node outputs and per-node states, one node at a time in topological order.

    ``S_n = step(S_parent(n), x_n)`` with the recurrence of docs/design.md; ``o_n = S_n^T q_n``.
    Returns ``(o [B, N, Hv, V] in v's dtype, snapshots f32 [B, N, Hv, K, V])``.

    ``impl``: ``"xla"`` (a loop over the nodes), ``"pallas"`` (the fused GPU kernel; interpret
    mode off a GPU) or ``"auto"`` (the kernel on a GPU for power-of-two head dims).
    """
    q, k, v, g, beta, parents, initial_state = as_arrays(q, k, v, g, beta, parents, initial_state)
    b, n, *_ = check_rule_inputs(q, k, v, g, beta, initial_state, time_name="N")
    parents = _check_parents(parents, b, n)
    kernel = resolve_impl(impl, "snapshot_tree_verify", q, k, v)
    if kernel != "xla":
        return pallas_op("snapshot_tree_verify", kernel)(
            q, k, v, g, beta, parents, initial_state, scale=scale, use_qk_l2norm=use_qk_l2norm
        )
    return _snapshot_xla(
        q, k, v, g, beta, parents, initial_state, scale=scale, use_qk_l2norm=use_qk_l2norm
    )


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm"))
def _snapshot_xla(q, k, v, g, beta, parents, initial_state, *, scale, use_qk_l2norm):
    b, n, hk, _ = k.shape
    hv, dv = v.shape[2:]
    qf, kf = prepare_qk(q, k, scale=scale, use_qk_l2norm=use_qk_l2norm)
    vg = group_heads(v.astype(jnp.float32), hk, 2)  # [B, N, Hk, Gr, V]
    gg = group_heads(g.astype(jnp.float32), hk, 2)
    bg = group_heads(beta.astype(jnp.float32), hk, 2)
    s0 = group_heads(initial_state.astype(jnp.float32), hk, 1)
    rows = jnp.arange(b)

    def step(i, carry):
        states, out = carry
        par = parents[:, i]
        s = jnp.where((par >= 0)[:, None, None, None, None], states[rows, jnp.maximum(par, 0)], s0)
        s = s * jnp.exp(gg[:, i])[..., None, None]
        kv = jnp.einsum("bhk,bhgkv->bhgv", kf[:, i], s, precision=HIGHEST)
        u = bg[:, i][..., None] * (vg[:, i] - kv)
        s = s + kf[:, i][:, :, None, :, None] * u[:, :, :, None, :]
        o = jnp.einsum("bhk,bhgkv->bhgv", qf[:, i], s, precision=HIGHEST)
        return states.at[:, i].set(s), out.at[:, i].set(o)

    # every node's slot is written by the loop; the buffer starts as the initial state so that
    # it exists only from this layer's input on (a zeros start is an input-free constant,
    # which XLA creates for every layer of a model at the program's start, all alive at once)
    states = jnp.broadcast_to(s0[:, None], (b, n) + s0.shape[1:])
    out = jnp.zeros((b, n, hk, hv // hk, dv), jnp.float32)
    states, out = jax.lax.fori_loop(0, n, step, (states, out))
    return ungroup_heads(out, 2).astype(v.dtype), ungroup_heads(states, 2)


def snapshot_tree_commit(
    initial_state: Float[Array, "B Hv K V"],
    snapshots: Float[Array, "B N Hv K V"],
    path: Int[Array, "B D"],
    path_len: Int[Array, " B"],
) -> Float[Array, "B Hv K V"]:
    """The accepted leaf's snapshot, or ``initial_state`` when ``path_len == 0``."""
    initial_state, snapshots, path, path_len = as_arrays(initial_state, snapshots, path, path_len)
    b = snapshots.shape[0]
    last = jnp.take_along_axis(path, jnp.maximum(path_len - 1, 0)[:, None], axis=1)[:, 0]
    leaf = snapshots[jnp.arange(b), jnp.clip(last, 0, snapshots.shape[1] - 1)]
    return jnp.where((path_len > 0)[:, None, None, None], leaf, initial_state.astype(jnp.float32))
