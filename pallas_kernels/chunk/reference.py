"""Plain-JAX reference of the chunked prefill: the specification of ``kernel.py``.

The chunked kernels compute what the plain token-by-token recurrence computes over each
sequence, from its initial state ``S0`` (zeros when none is given), per value head ``h`` (key
head ``h // (Hv // Hk)``)::

    S = exp(g_t) S;   u_t = beta_t (v_t - S^T k_t);   S = S + k_t u_t^T;   o_t = S^T q_t

after the optional l2norm of ``q`` and ``k`` and ``q *= scale`` (default ``K ** -0.5``); the
final state is ``S`` after the sequence's last token (``S0`` for an empty sequence).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._reference import F32, delta_step, prepare_qk, value_heads


@jax.jit
def recurrence(q, k, v, g, beta, initial_state):
    """One sequence: prepared f32 ``q, k [T, Hv, K]`` (already repeated to the value heads),
    ``v [T, Hv, V]``, ``g, beta [T, Hv]``, ``initial_state [Hv, K, V]``. Returns
    ``(o f32 [T, Hv, V], final state f32 [Hv, K, V])`` by a scan over the tokens."""

    def token(s, x):
        s, o, _ = delta_step(s, *x)
        return s, o

    xs = (q, k, v.astype(F32), g.astype(F32), beta.astype(F32))
    final, o = jax.lax.scan(token, initial_state.astype(F32), xs)
    return o, final


def chunk_reference(
    q,
    k,
    v,
    g,
    beta,
    initial_state=None,
    *,
    scale=None,
    use_qk_l2norm=False,
    output_final_state=True,
    cu_seqlens=None,
):
    """Gated delta rule over whole sequences, token by token (module docstring).

    ``q, k [B, T, Hk, K]``, ``v [B, T, Hv, V]``, ``g, beta [B, T, Hv]``, ``initial_state
    [B or S, Hv, K, V]`` (optional). With ``cu_seqlens`` (concrete ints ``[S + 1]``, from 0 to
    ``T``; ``B == 1``) the ``T`` axis packs ``S`` sequences, each from its own initial state.
    Returns ``(o [B, T, Hv, V] in v's dtype, final state f32 [B or S, Hv, K, V] or None)``, as
    :func:`pallas_kernels.chunk.chunk_gated_delta_rule`.
    """
    b, t, _, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    q, k = prepare_qk(q, k, scale, use_qk_l2norm)
    q, k = value_heads(q, hv, axis=2), value_heads(k, hv, axis=2)
    if cu_seqlens is None:
        pieces = [(r, 0, t) for r in range(b)]
    else:
        cu = [int(x) for x in cu_seqlens]  # concrete: the pieces are Python slices
        pieces = [(0, a, e) for a, e in zip(cu[:-1], cu[1:], strict=True)]
    if initial_state is None:
        initial_state = jnp.zeros((len(pieces), hv, dk, dv), F32)
    outs, finals = [], []
    for i, (r, a, e) in enumerate(pieces):
        o, final = recurrence(*(x[r, a:e] for x in (q, k, v, g, beta)), initial_state[i])
        outs.append(o)
        finals.append(final)
    o = jnp.stack(outs) if cu_seqlens is None else jnp.concatenate(outs)[None]
    return o.astype(v.dtype), (jnp.stack(finals) if output_final_state else None)
