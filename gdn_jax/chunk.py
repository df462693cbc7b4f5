"""The gated delta rule in chunked WY form (prefill), with packed variable-length batches.

Within a chunk of ``C`` tokens with in-chunk cumulative log decay ``Gc`` and entering state ``S``
(docs/design.md for a chain tree)::

    A[i, j] = beta_i exp(Gc_i - Gc_j) (k_i . k_j)            j < i
    (I + A) U = diag(beta) (V - diag(exp(Gc)) K S)            one unit-lower-triangular solve
    O = diag(exp(Gc)) Q S + ((Q K^T) * D) U,                  D[i, j] = exp(Gc_i - Gc_j), j <= i
    S' = exp(Gc_C) S + K^T diag(exp(Gc_C - Gc)) U

The solve is split as ``U = W1 - W2 S`` with ``W1 = (I + A)^-1 diag(beta) V`` and
``W2 = (I + A)^-1 diag(beta exp(Gc)) K``, so all solves run in parallel over chunks and only the
cheap state update is sequential (``lax.scan`` over chunks).
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
from gdn_jax.solve import unit_lower_solve


def masked_decay(gi: jax.Array, gj: jax.Array, mask: jax.Array) -> jax.Array:
    """``where(mask, exp(gi - gj), 0)`` with the difference masked before ``exp``.

    Masking first keeps entries outside ``mask`` (where ``gi - gj`` may be large and positive)
    from becoming ``inf`` and then ``inf * 0 = NaN`` (docs/design.md, numerics).
    """
    diff = jnp.where(mask, gi - gj, 0.0)
    return jnp.where(mask, jnp.exp(diff), 0.0)


def _chunk_terms(qc, kc, vc, gc, bc):
    """Per-chunk WY terms. Inputs ``[..., Hk, C, K]`` / ``[..., Hk, G, C, V]`` / ``[..., Hk, G, C]``."""
    c = kc.shape[-2]
    gcum = jnp.cumsum(gc, axis=-1)
    idx = jnp.arange(c)
    strict = idx[:, None] > idx[None, :]
    incl = idx[:, None] >= idx[None, :]
    gi, gj = gcum[..., :, None], gcum[..., None, :]
    kk = jnp.einsum("...hik,...hjk->...hij", kc, kc, precision=HIGHEST)[..., :, None, :, :]
    a = bc[..., :, None] * masked_decay(gi, gj, strict) * kk
    rhs_k = (bc * jnp.exp(gcum))[..., None] * kc[..., :, None, :, :]
    rhs_v = bc[..., None] * vc
    rhs = jnp.concatenate([rhs_v, rhs_k], axis=-1)
    sol = unit_lower_solve(a, rhs)
    w1, w2 = sol[..., : vc.shape[-1]], sol[..., vc.shape[-1] :]
    qk = jnp.einsum("...hik,...hjk->...hij", qc, kc, precision=HIGHEST)[..., :, None, :, :]
    aqk = qk * masked_decay(gi, gj, incl)
    return w1, w2, aqk, gcum


def _chunk_scan(qc, kc, w1, w2, aqk, gcum, s_init, resets):
    """Sequential state pass over chunks. Leading axis of every per-chunk input is the chunk.

    ``resets`` is ``None`` (one sequence per batch row) or ``(h0, first, last, seq)`` for packed
    sequences: at a chunk with ``first`` the state restarts from ``h0[seq]``; after a chunk with
    ``last`` the state is recorded as sequence ``seq``'s final state.
    """

    def body(carry, xs):
        s, finals = carry
        q_c, k_c, w1_c, w2_c, aqk_c, g_c, first, last, seq = xs
        if resets is not None:
            s = jnp.where(first, resets[0][seq][None], s)
        u = w1_c - jnp.einsum("bhgck,bhgkv->bhgcv", w2_c, s, precision=HIGHEST)
        qs = jnp.einsum("bhck,bhgkv->bhgcv", q_c, s, precision=HIGHEST)
        o = jnp.exp(g_c)[..., None] * qs + jnp.einsum(
            "bhgij,bhgjv->bhgiv", aqk_c, u, precision=HIGHEST
        )
        g_last = g_c[..., -1]
        decay_u = jnp.exp(g_last[..., None] - g_c)[..., None] * u
        s = jnp.exp(g_last)[..., None, None] * s + jnp.einsum(
            "bhck,bhgcv->bhgkv", k_c, decay_u, precision=HIGHEST
        )
        if resets is not None:
            finals = finals.at[seq].set(jnp.where(last, s[0], finals[seq]))
        return (s, finals), o

    nc = qc.shape[0]
    if resets is None:
        flags = (jnp.zeros((nc,), bool), jnp.zeros((nc,), bool), jnp.zeros((nc,), jnp.int32))
        finals0 = jnp.zeros((0,), jnp.float32)
    else:
        flags = resets[1:]
        finals0 = resets[0]
    (s, finals), o = jax.lax.scan(
        body, (s_init, finals0), (qc, kc, w1, w2, aqk, gcum) + tuple(flags)
    )
    return o, s, finals


def _to_chunks(x: jax.Array, c: int) -> jax.Array:
    """``[B, T, ...] -> [T/C, B, ..., C, ...]``: chunk-major, with the in-chunk axis after heads."""
    b, t = x.shape[:2]
    x = x.reshape((b, t // c, c) + x.shape[2:])
    x = jnp.moveaxis(x, 1, 0)  # [NC, B, C, ...]
    return jnp.moveaxis(x, 2, 3) if x.ndim >= 4 else x  # [NC, B, H, C, ...] or [NC, B, C]


def _pad_time(x: jax.Array, t_pad: int) -> jax.Array:
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, t_pad - x.shape[1])
    return jnp.pad(x, pad)


def _varlen_plan(cu: jax.Array, t: int, c: int):
    """Lays packed sequences out so that every sequence starts at a chunk boundary.

    Returns, for ``NC = ceil(T / C) + S`` chunks, the packed source index of every padded slot,
    its validity, per-chunk ``first``/``last``/``seq`` flags and, per packed token, its slot.
    Works on traced ``cu_seqlens``; all shapes depend only on ``T``, ``C`` and ``S``.
    """
    n_seq = cu.shape[0] - 1
    nc = -(-t // c) + n_seq
    lens = cu[1:] - cu[:-1]
    nch = (lens + c - 1) // c
    cend = jnp.cumsum(nch)
    cstart = cend - nch
    chunk = jnp.arange(nc)
    seq_raw = jnp.searchsorted(cend, chunk, side="right")
    real = seq_raw < n_seq
    seq = jnp.minimum(seq_raw, n_seq - 1)
    within = chunk - cstart[seq]
    tok_off = within[:, None] * c + jnp.arange(c)[None, :]
    valid = real[:, None] & (tok_off < lens[seq][:, None])
    src = jnp.where(valid, cu[seq][:, None] + tok_off, 0).reshape(-1)
    first = real & (within == 0)
    last = real & (within == nch[seq] - 1)
    tok = jnp.arange(t)
    tseq = jnp.searchsorted(cu[1:], tok, side="right")
    tseq = jnp.minimum(tseq, n_seq - 1)
    slot = cstart[tseq] * c + tok - cu[tseq]
    return nc, src, valid.reshape(-1), first, last, seq.astype(jnp.int32), slot


def _check_cu_seqlens(cu_seqlens, b: int, t: int, initial_state) -> None:
    from gdn_jax._prep import concrete

    if b != 1:
        raise ValueError(f"cu_seqlens: packed sequences need batch size 1, got B={b}")
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(
            f"cu_seqlens: expected a 1-D array of S+1 >= 2 offsets, got {cu_seqlens.shape}"
        )
    if not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
        raise ValueError(f"cu_seqlens: must be integer, got {cu_seqlens.dtype}")
    n_seq = cu_seqlens.shape[0] - 1
    if initial_state is not None and initial_state.shape[0] != n_seq:
        raise ValueError(
            f"initial_state: with cu_seqlens of {n_seq} sequences expected {n_seq} states, "
            f"got leading dim {initial_state.shape[0]}"
        )
    cu = concrete(cu_seqlens)
    if cu is not None:
        if cu[0] != 0 or cu[-1] != t:
            raise ValueError(f"cu_seqlens: must start at 0 and end at T={t}, got {cu[0]}..{cu[-1]}")
        if (cu[1:] < cu[:-1]).any():
            raise ValueError("cu_seqlens: offsets must be non-decreasing")


def chunk_gated_delta_rule(
    q: Float[Array, "B T Hk K"],
    k: Float[Array, "B T Hk K"],
    v: Float[Array, "B T Hv V"],
    g: Float[Array, "B T Hv"],
    beta: Float[Array, "B T Hv"],
    initial_state: Float[Array, "B Hv K V"] | None = None,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    output_final_state: bool = True,
    chunk_size: int = 64,
    cu_seqlens: Int[Array, " S1"] | None = None,
    impl: str = "auto",
) -> tuple[Float[Array, "B T Hv V"], Float[Array, "B Hv K V"] | None]:
    """The gated delta rule over a whole sequence in chunked WY form (see module docstring).

    Same result as :func:`recurrent_gated_delta_rule` (up to f32 rounding). With ``cu_seqlens``
    (``[S + 1]`` int offsets, ``B == 1``) the ``T`` axis packs ``S`` independent sequences;
    ``initial_state`` and the returned final state are then ``[S, Hv, K, V]``.

    Returns ``(o [B, T, Hv, V] in v's dtype, S_final f32 or None)``.
    """
    q, k, v, g, beta, initial_state, cu_seqlens = as_arrays(
        q, k, v, g, beta, initial_state, cu_seqlens
    )
    state_batch = None if cu_seqlens is None else cu_seqlens.shape[0] - 1
    b, t, *_ = check_rule_inputs(q, k, v, g, beta, initial_state, state_batch=state_batch)
    if chunk_size < 1:
        raise ValueError(f"chunk_size: must be positive, got {chunk_size}")
    if cu_seqlens is not None:
        _check_cu_seqlens(cu_seqlens, b, t, initial_state)
    kernel = resolve_impl(impl, "chunk_gated_delta_rule", q, k, v, chunk_size)
    if kernel != "xla":
        return pallas_op("chunk_gated_delta_rule", kernel)(
            q,
            k,
            v,
            g,
            beta,
            initial_state,
            scale=scale,
            use_qk_l2norm=use_qk_l2norm,
            output_final_state=output_final_state,
            chunk_size=chunk_size,
            cu_seqlens=cu_seqlens,
        )
    return _chunk_xla(
        q,
        k,
        v,
        g,
        beta,
        initial_state,
        cu_seqlens,
        scale=scale,
        use_qk_l2norm=use_qk_l2norm,
        output_final_state=output_final_state,
        chunk_size=chunk_size,
    )


@functools.partial(
    jax.jit, static_argnames=("scale", "use_qk_l2norm", "output_final_state", "chunk_size")
)
def _chunk_xla(
    q,
    k,
    v,
    g,
    beta,
    initial_state,
    cu_seqlens,
    *,
    scale,
    use_qk_l2norm,
    output_final_state,
    chunk_size,
):
    b, t, hk, dk = k.shape
    hv, dv = v.shape[2:]
    c = chunk_size
    qf, kf = prepare_qk(q, k, scale=scale, use_qk_l2norm=use_qk_l2norm)
    vf, gf, bf = v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32)

    if cu_seqlens is None:
        t_pad = -(-t // c) * c
        # Padding tokens have k = 0, beta = 0 and g = 0: they leave the state unchanged.
        qf, kf, vf, gf, bf = (_pad_time(x, t_pad) for x in (qf, kf, vf, gf, bf))
        s_init = (
            jnp.zeros((b, hv, dk, dv), jnp.float32)
            if initial_state is None
            else initial_state.astype(jnp.float32)
        )
        resets = None
    else:
        n_seq = cu_seqlens.shape[0] - 1
        nc, src, valid, first, last, seq, slot = _varlen_plan(cu_seqlens.astype(jnp.int32), t, c)

        def gather(x):
            y = jnp.take(x[0], src, axis=0)
            mask = valid.reshape((-1,) + (1,) * (y.ndim - 1))
            return jnp.where(mask, y, 0.0)[None]

        qf, kf, vf, gf, bf = (gather(x) for x in (qf, kf, vf, gf, bf))
        h0 = (
            jnp.zeros((n_seq, hv, dk, dv), jnp.float32)
            if initial_state is None
            else initial_state.astype(jnp.float32)
        )
        s_init = jnp.zeros((1, hv, dk, dv), jnp.float32)
        resets = (group_heads(jnp.asarray(h0), hk, 1), first, last, seq)

    qc, kc = _to_chunks(qf, c), _to_chunks(kf, c)  # [NC, B, Hk, C, K]
    vc = group_heads(_to_chunks(vf, c), hk, 2)  # [NC, B, Hk, G, C, V]
    gc = group_heads(_to_chunks(gf, c), hk, 2)  # [NC, B, Hk, G, C]
    bc = group_heads(_to_chunks(bf, c), hk, 2)
    w1, w2, aqk, gcum = _chunk_terms(qc, kc, vc, gc, bc)
    o, s_final, finals = _chunk_scan(qc, kc, w1, w2, aqk, gcum, group_heads(s_init, hk, 1), resets)

    o = ungroup_heads(o, 2)  # [NC, B, Hv, C, V]
    o = jnp.moveaxis(jnp.moveaxis(o, 3, 2), 0, 1)  # [B, NC, C, Hv, V]
    o = o.reshape((o.shape[0], -1) + o.shape[3:])
    if cu_seqlens is None:
        o = o[:, :t]
        final = ungroup_heads(s_final, 1)
    else:
        o = jnp.take(o, slot, axis=1)
        final = ungroup_heads(finals, 1)
    return o.astype(v.dtype), (final if output_final_state else None)
