"""Plain-JAX pieces shared by the op folders' ``reference.py`` files (no Pallas).

- :func:`prepare_qk`: the optional l2norm of ``q`` and ``k`` and the scale of ``q``;
- :func:`value_heads`: a key-head tensor repeated to the value heads (grouped heads);
- :func:`delta_step`: one token of the gated delta rule on f32 states ``[Hv, K, V]``;
- :func:`read_states` / :func:`write_states`: the recurrent states of a batch in the serving
  memory arena, addressed through the handle table, as a dense ``[B, Hv, K, V]`` array.

Everything is f32 with ``precision=HIGHEST`` dots.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST
L2NORM_EPS = 1e-6


def l2norm(x: jax.Array) -> jax.Array:
    """``x * rsqrt(sum(x * x, -1) + 1e-6)`` in f32."""
    x = x.astype(F32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def prepare_qk(q, k, scale: float | None, use_qk_l2norm: bool):
    """f32 ``(q * scale, k)`` after the optional l2norm of both (``scale`` default ``K ** -0.5``)."""
    q, k = q.astype(F32), k.astype(F32)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return q * scale, k


def value_heads(x: jax.Array, hv: int, axis: int) -> jax.Array:
    """Key heads on ``axis`` repeated to ``hv`` value heads: value head ``h`` reads key head
    ``h // (hv // Hk)``."""
    return jnp.repeat(x, hv // x.shape[axis], axis=axis)


def delta_step(s, q, k, v, g, beta):
    """One token of the gated delta rule for every value head.

    ``s`` f32 ``[Hv, K, V]``; prepared ``q, k [Hv, K]``; ``v [Hv, V]``; ``g, beta [Hv]``::

        S = exp(g) S;   u = beta (v - S^T k);   S = S + k u^T;   o = S^T q

    Returns ``(S, o [Hv, V], u [Hv, V])``, all f32.
    """
    s = jnp.exp(g.astype(F32))[:, None, None] * s
    sk = jnp.einsum("hkv,hk->hv", s, k, precision=HIGHEST)
    u = beta.astype(F32)[:, None] * (v.astype(F32) - sk)
    s = s + k[:, :, None] * u[:, None, :]
    o = jnp.einsum("hkv,hk->hv", s, q, precision=HIGHEST)
    return s, o, u


def _unit_start(table, handle, offset):
    """``(valid, segment, first word)`` of a handle's field at ``offset`` words into its unit."""
    seg, word = table[jnp.maximum(handle, 0)]
    return handle >= 0, seg, word + offset


def read_states(arena, table, handles, *, state_offset: int, shape) -> jax.Array:
    """f32 ``[B, *shape]`` states: row ``b``'s state is the ``prod(shape)`` words at word
    ``table[handles[b], 1] + state_offset`` of segment ``table[handles[b], 0]`` of the
    ``uint32 [segments, words]`` arena, bitcast to f32; zeros where ``handles[b] < 0``."""
    size = math.prod(shape)

    def one(handle):
        valid, seg, start = _unit_start(table, handle, state_offset)
        words = jax.lax.dynamic_slice(arena[seg], (start,), (size,))
        s = jax.lax.bitcast_convert_type(words, F32).reshape(shape)
        return jnp.where(valid, s, 0.0)

    return jax.vmap(one)(handles)


def write_states(arena, table, handles, states, *, state_offset: int) -> jax.Array:
    """``arena`` with row ``b``'s f32 state ``states[b]`` stored at the words
    :func:`read_states` reads it from, for every ``handles[b] >= 0``; no other word changes."""

    def one(b, arena):
        valid, seg, start = _unit_start(table, handles[b], state_offset)
        new = jax.lax.bitcast_convert_type(states[b].astype(F32), jnp.uint32).reshape(1, -1)
        old = jax.lax.dynamic_slice(arena, (seg, start), new.shape)
        return jax.lax.dynamic_update_slice(arena, jnp.where(valid, new, old), (seg, start))

    return jax.lax.fori_loop(0, handles.shape[0], one, arena)
