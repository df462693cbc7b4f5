"""The gated delta rule token by token on recurrent states read from, and written back into,
the serving memory arena in place: one decode token per row (:func:`recurrent_step`) or ``T``
tokens per row (:func:`recurrent_prefill`, a prefill chunk with ragged ``num_tokens``).

Batch row ``b``'s f32 state ``[Hv, K, V]`` starts at word ``table[handles[b], 1] +
state_offset`` of segment ``table[handles[b], 0]`` (:mod:`pallas_kernels._arena`). Each program
``(b, h, j)`` loads its ``[K, block_v]`` tile with one indexed load, runs its row's tokens on the
tile in registers and stores the final tile once into the aliased (donated) arena with one
masked indexed store. No program reads another program's tile, so the update is race free as
long as no two valid rows share a handle.

Per token and value head ``h`` (key head ``h // (Hv // Hk)``), as
:func:`gdn_jax.recurrent_gated_delta_rule`::

    S = exp(g) S;   u = beta (v - S^T k);   S = S + k u^T;   o = S^T q

with ``q`` scaled by ``scale`` (default ``K ** -0.5``) after the optional l2norm of q and k
(``x * rsqrt(sum(x * x) + 1e-6)``), all in f32; ``o`` has ``v``'s dtype.

:func:`recurrent_prefill` is a sequential scan over ``T``, not a chunked (WY) formulation: ``T``
dependent rank-1 updates of a tile already in registers, which suits the engine's prefill chunks
(at most 64 tokens); a long ``T`` is better served by the chunked kernel
(:mod:`pallas_kernels.chunk`). Tokens ``t >= num_tokens[b]`` leave the state unchanged and their
output is ``S^T q`` of the unchanged state (as the XLA path's ``g = beta = 0`` padding gives).

Rows: a handle ``< 0`` (padding) runs from a zero state and is never written; ``zero_state[b]``
(optional) starts a valid row from a zero state (a fresh request, whose unit holds stale bits)
and still writes it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._arena import check_arena, load_state, store_state, tile_address, whole
from pallas_kernels._wy import F32, check_heads_dims, next_pow2, pad_axis, prep_rows


def _check_inputs(q, k, v, g, beta, block_v, *, tokens: bool = False):
    """Shapes ``(B, Hk, Hv, K, V)`` of one token per row (``[B, ...]`` inputs) or, with
    ``tokens``, of ``T`` tokens per row (``[B, T, ...]``; then ``B`` is ``(B, T)``)."""
    lead, n = ("B, T", 2) if tokens else ("B", 1)
    if k.ndim != n + 2:
        raise ValueError(f"k: expected rank {n + 2} [{lead}, Hk, K], got shape {k.shape}")
    b, (hk, dk) = k.shape[:n], k.shape[n:]
    if q.shape != k.shape:
        raise ValueError(f"q: shape {q.shape} must equal k's shape {k.shape} [{lead}, Hk, K]")
    if v.ndim != n + 2 or v.shape[:n] != b:
        raise ValueError(f"v: expected [{lead}={b[0] if n == 1 else b}, Hv, V], got {v.shape}")
    hv, dv = v.shape[n:]
    check_heads_dims(q, k, v, hk=hk, dk=dk, hv=hv, dv=dv)
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (*b, hv):
            raise ValueError(f"{name}: expected shape [{lead}, Hv] = {(*b, hv)}, got {x.shape}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name}: must be floating point, got {x.dtype}")
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"block_v: a power of two >= 16, got {block_v}")
    return (b[0] if n == 1 else b), hk, hv, dk, dv


def row_flags(name, x, b, default: int = 0):
    """An optional ``[B]`` per-row argument as int32 (``None``: ``default`` for every row)."""
    if x is None:
        return jnp.full((b,), default, jnp.int32)
    if x.shape != (b,):
        raise ValueError(f"{name}: expected shape [B] = ({b},), got {x.shape}")
    return x.astype(jnp.int32)


def _addressing(handles, table):
    """``(handles, table)`` as the kernels' int32 operands."""
    return handles.astype(jnp.int32), table.astype(jnp.int32)


def delta_update(s, k, v, g, beta):
    """One token's update of a ``[K, block_v]`` f32 state tile: ``S = exp(g) S; S += k (beta
    (v - S^T k))^T`` with ``k [K]`` (prepared, f32), ``v [block_v]`` and scalars ``g, beta``."""
    s = s * jnp.exp(g.astype(F32))
    u = beta.astype(F32) * (v.astype(F32) - jnp.sum(k[:, None] * s, 0))
    return s + k[:, None] * u[None, :]


def readout(s, q):
    """``o = S^T q`` (f32 ``[block_v]``) of a ``[K, block_v]`` tile and a prepared ``q [K]``."""
    return jnp.sum(q[:, None] * s, 0)


def recurrent_step(
    q,
    k,
    v,
    g,
    beta,
    arena,
    table,
    handles,
    *,
    state_offset: int,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    zero_state=None,
    block_v: int = 64,
    num_warps: int = 4,
    interpret: bool = False,
):
    """One token of the gated delta rule per batch row on the arena's states, in place.

    Args:
      q, k: ``[B, Hk, K]``; v: ``[B, Hv, V]`` (f32, bf16 or f16; the math is f32).
      g, beta: ``[B, Hv]`` log decay and write strength.
      arena: ``uint32 [segments, words]`` (aliased to the second output: donate it).
      table: ``int [handles, 2]`` handle -> ``(segment, word)`` (entries must be in bounds,
        also the one a padding row reads through, ``table[0]``).
      handles: ``int [B]``; ``< 0``: padding (zero state, never written).
      state_offset: words from a unit's start to this layer's state.
      zero_state: optional ``bool [B]``: rows that start from a zero state (still written).

    Returns ``(o [B, Hv, V] in v's dtype, arena)``.
    """
    b, hk, hv, dk, dv = _check_inputs(q, k, v, g, beta, block_v)
    check_arena(arena, table, handles, b, state_offset, hv, dk, dv)
    zero_state = row_flags("zero_state", zero_state, b)
    bv = min(block_v, dv)
    grp = hv // hk
    scale = dk**-0.5 if scale is None else float(scale)

    def kernel(
        q_ref, k_ref, v_ref, g_ref, beta_ref, zs_ref, hd_ref, tab_ref, ar_ref, o_ref, out_ref
    ):
        i, h = pl.program_id(0), pl.program_id(1)
        ok, seg, idx = tile_address(hd_ref, tab_ref, offset=state_offset, dk=dk, dv=dv, bv=bv)
        s = load_state(ar_ref, (ok & (zs_ref[i] == 0), seg, idx))  # [K, bv] f32
        qv = prep_rows(q_ref[...], use_qk_l2norm, scale)  # [K]
        kv = prep_rows(k_ref[...], use_qk_l2norm)
        s = delta_update(s, kv, v_ref[...], g_ref[i, h], beta_ref[i, h])
        o_ref[...] = readout(s, qv).astype(o_ref.dtype)
        store_state(out_ref, (ok, seg, idx), s)

    vec_k = pl.BlockSpec((None, None, dk), lambda i, h, j: (i, h // grp, 0))
    vec_v = pl.BlockSpec((None, None, bv), lambda i, h, j: (i, h, j))
    o, arena = pl.pallas_call(
        kernel,
        grid=(b, hv, dv // bv),
        in_specs=[vec_k, vec_k, vec_v, *[whole()] * 6],
        out_specs=(vec_v, whole()),
        out_shape=(
            jax.ShapeDtypeStruct(v.shape, v.dtype),
            jax.ShapeDtypeStruct(arena.shape, arena.dtype),
        ),
        input_output_aliases={8: 1},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="gdn_recurrent_step_arena",
    )(q, k, v, g.astype(F32), beta.astype(F32), zero_state, *_addressing(handles, table), arena)
    return o, arena


def _softplus(x):
    """``log(1 + exp(x))`` in a form that neither overflows nor loses small values."""
    return jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x)))


def step_gates(a, b, a_log, dt_bias):
    """The decay and write strength of a Gated DeltaNet token from its raw projections (the
    model's rule, :meth:`gdn_jax.models.gdn.GatedDeltaNet.project`), in f32:
    ``g = -exp(A_log) softplus(a + dt_bias)``, ``beta = sigmoid(b)``."""
    a, b = a.astype(F32), b.astype(F32)
    g = -jnp.exp(a_log.astype(F32)) * _softplus(a + dt_bias.astype(F32))
    return g, 1.0 / (1.0 + jnp.exp(-b))


def recurrent_step_mixed(
    mixed,
    a,
    b,
    a_log,
    dt_bias,
    arena,
    table,
    handles,
    *,
    num_k_heads: int,
    head_k_dim: int,
    state_offset: int,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    zero_state=None,
    live=None,
    a_col: int = 0,
    b_col: int = 0,
    norm_weight=None,
    z=None,
    z_col: int = 0,
    norm_eps: float = 1e-6,
    block_v: int = 64,
    num_warps: int | None = None,
    interpret: bool = False,
):
    """:func:`recurrent_step` on the layer's raw inputs: the conv's output channels
    ``mixed [B, C]`` (``[q | k | v]``, ``C = 2 Hk K + Hv V``) and the gate projections
    ``a, b [B, Hv]`` with the layer's ``a_log, dt_bias [Hv]``; each program reads its q, k and
    v slices of ``mixed`` and forms ``g, beta`` itself (:func:`step_gates`), so no XLA kernel
    splits the channels or computes the gates. ``live`` (optional ``bool [B]``): rows whose
    token is padding (``False``) leave their state unchanged (``g = beta = 0``, as the
    model's ``num_tokens`` masking), their output the unchanged state's readout. ``a`` and
    ``b`` may be wider arrays (any float dtype, read as f32) whose ``Hv`` columns start at
    ``a_col`` and ``b_col``: both can be a fused input projection's output, read in place.

    ``norm_weight [V]`` (optional) with ``z [B, >= z_col + Hv V]``: each program also applies
    the layer's gated RMSNorm to its head's output, ``o = (w * rmsnorm(o)) * silu(z_h)`` with
    ``z_h`` the ``V`` columns of ``z`` from ``z_col + h V`` (the roundings of
    :class:`gdn_jax.models.norm.GatedRMSNorm`: ``o`` and the normed ``o`` rounded to ``o``'s
    dtype, the weight's product rounded to it, the gate's product in f32), so no kernel runs
    between this one and the output projection. A program then holds a whole value head
    (``block_v`` is taken as ``V``, a power of two). ``num_warps`` defaults to 8 with the
    norm, 4 without.

    Returns ``(o [B, Hv, V] in mixed's dtype, arena)``."""
    if mixed.ndim != 2:
        raise ValueError(f"mixed: expected [B, C], got shape {mixed.shape}")
    bsz, c = mixed.shape
    if dt_bias.ndim != 1:
        raise ValueError(f"dt_bias: expected [Hv], got shape {dt_bias.shape}")
    hv, hk, dk = dt_bias.shape[0], num_k_heads, head_k_dim
    if a_log.shape != (hv,):
        raise ValueError(f"a_log: expected shape [Hv] = ({hv},), got {a_log.shape}")
    for name, x, col in (("a", a, a_col), ("b", b, b_col)):
        if x.ndim != 2 or x.shape[0] != bsz or col < 0 or col + hv > x.shape[1]:
            raise ValueError(
                f"{name}: expected [B={bsz}, >= {name}_col + Hv = {col} + {hv}], got shape "
                f"{x.shape}"
            )
    if hk < 1 or (c - 2 * hk * dk) <= 0 or (c - 2 * hk * dk) % hv:
        raise ValueError(
            f"mixed: {c} channels are not 2 * Hk * K + Hv * V with Hk = {hk}, K = {dk}, Hv = {hv}"
        )
    dv = (c - 2 * hk * dk) // hv
    check_heads_dims(mixed, mixed, mixed, hk=hk, dk=dk, hv=hv, dv=dv)
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"block_v: a power of two >= 16, got {block_v}")
    check_arena(arena, table, handles, bsz, state_offset, hv, dk, dv)
    zero_state = row_flags("zero_state", zero_state, bsz)
    live = row_flags("live", live, bsz, default=1)
    normed = norm_weight is not None
    if normed:
        check_gated_norm(norm_weight, z, z_col, bsz, hv, dv)
        block_v = dv
    elif z is not None:
        raise ValueError("z: the gate of the norm, given only with norm_weight")
    bv = min(block_v, dv)
    num_warps = num_warps or (8 if normed else 4)
    grp = hv // hk
    v0 = 2 * hk * dk // bv  # v's first block of bv channels
    scale = dk**-0.5 if scale is None else float(scale)

    def kernel(
        q_ref, k_ref, v_ref, a_ref, b_ref, al_ref, dt_ref, lv_ref, zs_ref, hd_ref, tab_ref, ar_ref,
        nw_ref, z_ref, o_ref, out_ref,
    ):  # fmt: skip
        i, h = pl.program_id(0), pl.program_id(1)
        ok, seg, idx = tile_address(hd_ref, tab_ref, offset=state_offset, dk=dk, dv=dv, bv=bv)
        s = load_state(ar_ref, (ok & (zs_ref[i] == 0), seg, idx))  # [K, bv] f32
        ai, bi = a_ref[i, a_col + h].astype(F32), b_ref[i, b_col + h].astype(F32)
        g, beta = step_gates(ai, bi, al_ref[h], dt_ref[h])
        on = lv_ref[i] != 0
        g, beta = jnp.where(on, g, 0.0), jnp.where(on, beta, 0.0)
        qv = prep_rows(q_ref[...], use_qk_l2norm, scale)  # [K]
        kv = prep_rows(k_ref[...], use_qk_l2norm)
        s = delta_update(s, kv, v_ref[...], g, beta)
        o = readout(s, qv)
        if normed:
            zh = z_ref[i, pl.ds(z_col + h * dv, dv)]
            o = gated_norm(o, nw_ref[...], zh, norm_eps, o_ref.dtype)
        o_ref[...] = o.astype(o_ref.dtype)
        store_state(out_ref, (ok, seg, idx), s)

    vec_q = pl.BlockSpec((None, dk), lambda i, h, j: (i, h // grp))
    vec_k = pl.BlockSpec((None, dk), lambda i, h, j: (i, hk + h // grp))
    vec_v = pl.BlockSpec((None, bv), lambda i, h, j: (i, v0 + h * (dv // bv) + j))
    out_v = pl.BlockSpec((None, None, bv), lambda i, h, j: (i, h, j))
    o, arena = pl.pallas_call(
        kernel,
        grid=(bsz, hv, dv // bv),
        in_specs=[vec_q, vec_k, vec_v, *[whole()] * 11],
        out_specs=(out_v, whole()),
        out_shape=(
            jax.ShapeDtypeStruct((bsz, hv, dv), mixed.dtype),
            jax.ShapeDtypeStruct(arena.shape, arena.dtype),
        ),
        input_output_aliases={11: 1},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="gdn_recurrent_step_mixed_arena",
    )(
        mixed,
        mixed,
        mixed,
        a,
        b,
        a_log.astype(F32),
        dt_bias.astype(F32),
        live,
        zero_state,
        *_addressing(handles, table),
        arena,
        # unused placeholders without the norm (a one-element array each)
        norm_weight if normed else live,
        z if normed else live,
    )
    return o, arena


def check_gated_norm(weight, z, z_col: int, bsz: int, hv: int, dv: int) -> None:
    """``ValueError`` for a gated norm's ``weight [V]`` and gate ``z [B, >= z_col + Hv V]``
    that :func:`recurrent_step_mixed` cannot take."""
    if weight.shape != (dv,):
        raise ValueError(f"norm_weight: expected shape [V] = ({dv},), got {weight.shape}")
    if z is None or z.ndim != 2 or z.shape[0] != bsz or z_col < 0 or z_col + hv * dv > z.shape[1]:
        shape = None if z is None else z.shape
        raise ValueError(
            f"z: expected [B={bsz}, >= z_col + Hv * V = {z_col} + {hv * dv}], got shape {shape}"
        )
    if dv & (dv - 1):
        raise ValueError(
            f"norm_weight: the norm takes a whole value head; V={dv} is not a power of two"
        )


def gated_norm(o, w, z, eps: float, dtype):
    """One value head's gated RMSNorm in-kernel, rounded as
    :class:`gdn_jax.models.norm.GatedRMSNorm`: ``o [V]`` f32 (rounded to ``dtype`` first),
    ``w [V]`` and ``z [V]`` in any float dtype; returns f32 (rounded to ``dtype`` by the
    caller)."""
    o = o.astype(dtype).astype(F32)
    xn = (o * jax.lax.rsqrt(jnp.mean(o * o) + eps)).astype(dtype).astype(F32)
    y = (w.astype(F32) * xn).astype(dtype).astype(F32)
    return y * silu(z.astype(F32))


def silu(x):
    """``x sigmoid(x)`` in-kernel (f32)."""
    return x / (1.0 + jnp.exp(-x))


def recurrent_prefill(
    q,
    k,
    v,
    g,
    beta,
    arena,
    table,
    handles,
    *,
    state_offset: int,
    num_tokens=None,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    zero_state=None,
    block_v: int = 64,
    num_warps: int = 4,
    interpret: bool = False,
):
    """``T`` tokens of the gated delta rule per batch row on the arena's states, in place.

    Args:
      q, k: ``[B, T, Hk, K]``; v: ``[B, T, Hv, V]`` (f32, bf16 or f16; the math is f32).
      g, beta: ``[B, T, Hv]`` log decay and write strength.
      arena: ``uint32 [segments, words]`` (aliased to the second output: donate it).
      table: ``int [handles, 2]`` handle -> ``(segment, word)`` (entries must be in bounds,
        also the one a padding row reads through, ``table[0]``).
      handles: ``int [B]``; ``< 0``: padding (zero state, never written).
      state_offset: words from a unit's start to this layer's state.
      num_tokens: optional ``int [B]`` tokens of each row that update the state (default
        ``T``); later tokens leave it unchanged.
      zero_state: optional ``bool [B]``: rows that start from a zero state (still written).

    Returns ``(o [B, T, Hv, V] in v's dtype, arena)``.
    """
    b, hk, hv, dk, dv = _check_inputs(q, k, v, g, beta, block_v, tokens=True)
    b, t = b
    if t < 1:
        raise ValueError(f"T: at least one token per row, got {t}")
    check_arena(arena, table, handles, b, state_offset, hv, dk, dv)
    zero_state = row_flags("zero_state", zero_state, b)
    if num_tokens is None:
        num_tokens = jnp.full((b,), t, jnp.int32)
    num_tokens = row_flags("num_tokens", num_tokens, b)
    bv = min(block_v, dv)
    grp = hv // hk
    scale = dk**-0.5 if scale is None else float(scale)
    tp = next_pow2(t)  # block shapes of powers of two (Triton); padded tokens are never live
    q, k, v = (pad_axis(x, 1, tp) for x in (q, k, v))
    g, beta = (pad_axis(jnp.swapaxes(x.astype(F32), 1, 2), 2, tp) for x in (g, beta))

    def kernel(
        q_ref,
        k_ref,
        v_ref,
        g_ref,
        beta_ref,
        nt_ref,
        zs_ref,
        hd_ref,
        tab_ref,
        ar_ref,
        o_ref,
        out_ref,
    ):
        i = pl.program_id(0)
        addr = tile_address(hd_ref, tab_ref, offset=state_offset, dk=dk, dv=dv, bv=bv)
        ok, seg, idx = addr
        n = nt_ref[i]

        def token(s_, s):
            qv = prep_rows(q_ref[s_, :], use_qk_l2norm, scale)  # [K]
            kv = prep_rows(k_ref[s_, :], use_qk_l2norm)
            new = delta_update(s, kv, v_ref[s_, :], g_ref[s_], beta_ref[s_])
            s = jnp.where(s_ < n, new, s)
            o_ref[s_, :] = readout(s, qv).astype(o_ref.dtype)
            return s

        s = load_state(ar_ref, (ok & (zs_ref[i] == 0), seg, idx))  # [K, bv] f32
        s = jax.lax.fori_loop(0, t, token, s)
        store_state(out_ref, addr, s)

    seq_k = pl.BlockSpec((None, tp, None, dk), lambda i, h, j: (i, 0, h // grp, 0))
    seq_v = pl.BlockSpec((None, tp, None, bv), lambda i, h, j: (i, 0, h, j))
    seq_g = pl.BlockSpec((None, None, tp), lambda i, h, j: (i, h, 0))
    o, arena = pl.pallas_call(
        kernel,
        grid=(b, hv, dv // bv),
        in_specs=[seq_k, seq_k, seq_v, seq_g, seq_g, *[whole()] * 5],
        out_specs=(seq_v, whole()),
        out_shape=(
            jax.ShapeDtypeStruct(v.shape, v.dtype),
            jax.ShapeDtypeStruct(arena.shape, arena.dtype),
        ),
        input_output_aliases={9: 1},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="gdn_recurrent_prefill_arena",
    )(q, k, v, g, beta, num_tokens, zero_state, *_addressing(handles, table), arena)
    return (o[:, :t] if tp != t else o), arena
