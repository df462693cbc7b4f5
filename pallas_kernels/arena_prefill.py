"""A prefill chunk of the gated delta rule (``T`` tokens per row, ragged ``num_tokens``) with the
recurrent states read from, and the final states written back into, the serving memory arena
in place (issue 5, the prefill step).

The arena, table and handle conventions are those of :mod:`pallas_kernels.arena` and
:mod:`pallas_kernels.arena_decode`: batch row ``b``'s f32 state ``[Hv, K, V]`` starts at word
``table[handles[b], 1] + state_offset`` of segment ``table[handles[b], 0]``. Each program
``(b, h, j)`` loads its ``[K, block_v]`` tile with one indexed load, runs the tokens of its row
one after the other on the tile in registers (:func:`pallas_kernels.arena_decode.delta_update`
and ``readout``, the decode step's math), writes ``o[b, t, h, j-block]`` per token and stores
the final tile once into the aliased (donated) arena with one masked indexed store. No program
reads another program's tile, so the update is race free as long as no two valid rows share a
handle.

This is a sequential scan over ``T``, not a chunked (WY) formulation: ``T`` dependent rank-1
updates of a ``[K, block_v]`` tile, each a few vector ops and two reductions over ``K``. The
serving engine prefills in chunks of ``prefill_chunk`` (<= 64) tokens, for which that is ``T``
short steps on data already in registers (the state is read and written once per chunk, which
is what the arena path is about); a long ``T`` would be better served by a chunked kernel whose
intra-chunk work runs on the tensor cores.

Tokens ``t >= num_tokens[b]`` leave the state unchanged and their output is ``S^T q`` of the
unchanged state (as the XLA path's ``g = beta = 0`` padding gives); ``q, k`` get the optional
l2norm and ``q`` the ``scale`` (default ``K ** -0.5``) exactly as
:func:`pallas_kernels.arena_decode.recurrent_step`; ``o`` has ``v``'s dtype.

Rows: a handle ``< 0`` (padding) runs from a zero state and is never written; ``zero_state[b]``
(optional) starts a valid row from a zero state (a fresh request, whose unit holds stale bits)
and still writes it (also when ``num_tokens[b] == 0``: then the zero state).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._wy import F32, next_pow2, pad_axis, prep_rows
from pallas_kernels.arena import _check_arena, _load_state, _store_state, _tile_address, _whole
from pallas_kernels.arena_decode import _check_inputs, _row_flags, delta_update, readout


def recurrent_prefill(
    q, k, v, g, beta, arena, table, handles, *, state_offset: int, num_tokens=None,
    scale: float | None = None, use_qk_l2norm: bool = False, zero_state=None,
    block_v: int = 64, num_warps: int = 4, interpret: bool = False,
):  # fmt: skip
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
    _check_arena(arena, table, handles, b, state_offset, hv, dk, dv)
    zero_state = _row_flags("zero_state", zero_state, b)
    if num_tokens is None:
        num_tokens = jnp.full((b,), t, jnp.int32)
    num_tokens = _row_flags("num_tokens", num_tokens, b)
    bv = min(block_v, dv)
    grp = hv // hk
    scale = dk**-0.5 if scale is None else float(scale)
    tp = next_pow2(t)  # block shapes of powers of two (Triton); padded tokens are never live
    q, k, v = (pad_axis(x, 1, tp) for x in (q, k, v))
    g, beta = (pad_axis(jnp.swapaxes(x.astype(F32), 1, 2), 2, tp) for x in (g, beta))

    def kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, nt_ref, zs_ref, hd_ref, tab_ref, ar_ref,
               o_ref, out_ref):  # fmt: skip
        i = pl.program_id(0)
        addr = _tile_address(hd_ref, tab_ref, offset=state_offset, dk=dk, dv=dv, bv=bv)
        ok, seg, idx = addr
        n = nt_ref[i]

        def token(s_, s):
            qv = prep_rows(q_ref[s_, :], use_qk_l2norm, scale)  # [K]
            kv = prep_rows(k_ref[s_, :], use_qk_l2norm)
            new = delta_update(s, kv, v_ref[s_, :], g_ref[s_], beta_ref[s_])
            s = jnp.where(s_ < n, new, s)
            o_ref[s_, :] = readout(s, qv).astype(o_ref.dtype)
            return s

        s = _load_state(ar_ref, (ok & (zs_ref[i] == 0), seg, idx))  # [K, bv] f32
        s = jax.lax.fori_loop(0, t, token, s)
        _store_state(out_ref, addr, s)

    seq_k = pl.BlockSpec((None, tp, None, dk), lambda i, h, j: (i, 0, h // grp, 0))
    seq_v = pl.BlockSpec((None, tp, None, bv), lambda i, h, j: (i, 0, h, j))
    seq_g = pl.BlockSpec((None, None, tp), lambda i, h, j: (i, h, 0))
    o, arena = pl.pallas_call(
        kernel,
        grid=(b, hv, dv // bv),
        in_specs=[seq_k, seq_k, seq_v, seq_g, seq_g, *[_whole()] * 5],
        out_specs=(seq_v, _whole()),
        out_shape=(jax.ShapeDtypeStruct(v.shape, v.dtype),
                   jax.ShapeDtypeStruct(arena.shape, arena.dtype)),  # fmt: skip
        input_output_aliases={9: 1},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="gdn_recurrent_prefill_arena",
    )(q, k, v, g, beta, num_tokens, zero_state, handles.astype(jnp.int32),
      table.astype(jnp.int32), arena)  # fmt: skip
    return (o[:, :t] if tp != t else o), arena
