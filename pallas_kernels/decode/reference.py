"""Plain-JAX reference of the token-by-token kernels: the specification of ``arena.py``.

Per token and value head ``h`` (key head ``h // (Hv // Hk)``), on f32 states ``S [K, V]``::

    S = exp(g) S;   u = beta (v - S^T k);   S = S + k u^T;   o = S^T q

after the optional l2norm of ``q`` and ``k`` and ``q *= scale`` (default ``K ** -0.5``). A
prefill runs ``T`` tokens per row; tokens ``t >= num_tokens[b]`` leave the state unchanged and
output ``S^T q`` of it. The arena forms read the initial states from, and write the final ones
back into, the serving memory arena through the handle table; a padding row (handle ``< 0``)
runs from a zero state and is never written, a ``zero_state`` row runs from a zero state and
is written.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._reference import (
    F32,
    HIGHEST,
    delta_step,
    prepare_qk,
    read_states,
    value_heads,
    write_states,
)


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm"))
def recurrent_prefill_reference(
    q, k, v, g, beta, initial_state, *, num_tokens=None, scale=None, use_qk_l2norm=False
):
    """``T`` tokens per row on dense states. ``q, k [B, T, Hk, K]``, ``v [B, T, Hv, V]``,
    ``g, beta [B, T, Hv]``, ``initial_state [B, Hv, K, V]``, ``num_tokens int [B]`` (default
    ``T``). Returns ``(o [B, T, Hv, V] in v's dtype, final state f32 [B, Hv, K, V])``."""
    b, t, hv = v.shape[:3]
    q, k = prepare_qk(q, k, scale, use_qk_l2norm)
    q, k = value_heads(q, hv, axis=2), value_heads(k, hv, axis=2)
    if num_tokens is None:
        num_tokens = jnp.full((b,), t, jnp.int32)

    def row(q, k, v, g, beta, s0, n):
        def token(s, x):
            i, q, k, v, g, beta = x
            new, _, _ = delta_step(s, q, k, v, g, beta)
            s = jnp.where(i < n, new, s)
            return s, jnp.einsum("hkv,hk->hv", s, q, precision=HIGHEST)

        final, o = jax.lax.scan(token, s0, (jnp.arange(t), q, k, v, g, beta))
        return o, final

    args = (v.astype(F32), g.astype(F32), beta.astype(F32), initial_state.astype(F32))
    o, final = jax.vmap(row)(q, k, *args, num_tokens)
    return o.astype(v.dtype), final


def recurrent_step_reference(q, k, v, g, beta, initial_state, *, scale=None, use_qk_l2norm=False):
    """One token per row on dense states. ``q, k [B, Hk, K]``, ``v [B, Hv, V]``, ``g, beta
    [B, Hv]``, ``initial_state [B, Hv, K, V]``. Returns ``(o [B, Hv, V] in v's dtype, new state
    f32 [B, Hv, K, V])``: :func:`recurrent_prefill_reference` with ``T = 1``."""
    o, s = recurrent_prefill_reference(
        *(x[:, None] for x in (q, k, v, g, beta)),
        initial_state,
        scale=scale,
        use_qk_l2norm=use_qk_l2norm,
    )
    return o[:, 0], s


def _arena_starts(arena, table, handles, zero_state, *, state_offset, shape):
    s0 = read_states(arena, table, handles, state_offset=state_offset, shape=shape)
    if zero_state is None:
        return s0
    return jnp.where(zero_state[:, None, None, None], 0.0, s0)


@functools.partial(jax.jit, static_argnames=("state_offset", "scale", "use_qk_l2norm"))
def recurrent_prefill_arena_reference(
    q,
    k,
    v,
    g,
    beta,
    arena,
    table,
    handles,
    *,
    state_offset,
    num_tokens=None,
    scale=None,
    use_qk_l2norm=False,
    zero_state=None,
):
    """:func:`recurrent_prefill_reference` on the arena's states: row ``b`` starts from the f32
    ``[Hv, K, V]`` state at word ``table[handles[b], 1] + state_offset`` of segment
    ``table[handles[b], 0]`` (zeros where ``handles[b] < 0`` or ``zero_state[b]``) and its
    final state is written back there (not for ``handles[b] < 0``). Returns ``(o, arena)``, as
    :func:`pallas_kernels.decode.arena.recurrent_prefill`."""
    shape = (v.shape[2], k.shape[3], v.shape[3])
    kw = dict(state_offset=state_offset, shape=shape)
    s0 = _arena_starts(arena, table, handles, zero_state, **kw)
    o, final = recurrent_prefill_reference(
        q, k, v, g, beta, s0, num_tokens=num_tokens, scale=scale, use_qk_l2norm=use_qk_l2norm
    )
    return o, write_states(arena, table, handles, final, state_offset=state_offset)


def recurrent_step_arena_reference(
    q,
    k,
    v,
    g,
    beta,
    arena,
    table,
    handles,
    *,
    state_offset,
    scale=None,
    use_qk_l2norm=False,
    zero_state=None,
):
    """:func:`recurrent_prefill_arena_reference` of one token: ``q, k [B, Hk, K]``,
    ``v [B, Hv, V]``, ``g, beta [B, Hv]``. Returns ``(o [B, Hv, V], arena)``, as
    :func:`pallas_kernels.decode.arena.recurrent_step`."""
    o, arena = recurrent_prefill_arena_reference(
        *(x[:, None] for x in (q, k, v, g, beta)),
        arena,
        table,
        handles,
        state_offset=state_offset,
        scale=scale,
        use_qk_l2norm=use_qk_l2norm,
        zero_state=zero_state,
    )
    return o[:, 0], arena
