"""An attention layer's decode step between its input projection and its attention, one kernel:
the q and k head norms, the partial rotary embedding and the new token's K and V written into
the memory manager's arena in place.

Input: the layer's fused projection output ``proj [B, C]`` (one token a row), read in place:
per query head ``[q_h | gate_h]`` (``gated``; else ``q_h`` alone), then the ``Hkv`` key heads,
then the ``Hkv`` value heads, ``D`` columns each (:class:`gdn_jax.models.attention.Attention`).
With ``r = rsqrt(mean(x^2) + eps)`` over a head's ``D`` values (f32):

    y = round(x r (1 + w))                                  (the zero-centred RMSNorm)
    out[d] = round(y[d] c[d] - y[d + R/2] s[d])             d < R/2
    out[d] = round(y[d] c[d] + y[d - R/2] s[d])             R/2 <= d < R
    out[d] = y[d]                                           d >= R

with ``c, s = round(cos, sin(pos * theta^(-2 (d mod R/2) / R)))``, ``round`` to the
projection's dtype (the XLA path's :func:`gdn_jax.models.rope.apply_rope` after
:class:`gdn_jax.models.norm.RMSNorm`, in f32 between its roundings). Query heads go to the
output ``q [B, Hq, D]``; key heads and the raw value heads go to row ``pos mod S`` of page
``pos // S`` of attention layer ``layer``'s K and V blocks (``serving.arena_spec``'s layout, as
:func:`pallas_kernels.attention.arena.paged_attention` reads it), in the cache dtype: bf16
pairs packed into ``uint32`` words (element ``2i`` in the low half), or f32 words. A row whose
``valid`` is 0, whose page lies past the page table or is unmapped (handle ``-1``) writes
nothing (the XLA path's write drops it).

Program ``(b, h)``, ``h < Hq + Hkv``, owns one head of row ``b`` and computes its even and odd
elements as two vectors of ``D / 2`` (each element's rotary partner gathered), so a K or V head
is stored as its ``D / 2`` packed words directly.

Replaces, at Qwen3.5's attention decode, XLA's ~10 small kernels (the head norms, the rotary
concatenations, the slices, the word packing and the two windowed writes into the arena).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._arena import whole

F32 = jnp.float32
HIGH_HALF = 0xFFFF0000


def check_prep(
    proj, q_norm, k_norm, positions, valid, arena, table, page_handles, *, num_heads, kv_heads,
    head_dim, rotary_dim, gated, kv_dtype, page_size,
):  # fmt: skip
    """``ValueError`` naming the argument for inputs :func:`attention_decode_prep` cannot
    take."""
    d = head_dim
    if not isinstance(d, int) or d < 16 or d & (d - 1):
        raise ValueError(f"head_dim: a power of two >= 16, got {d!r}")
    if not isinstance(rotary_dim, int) or rotary_dim < 2 or rotary_dim % 2 or rotary_dim > d:
        raise ValueError(f"rotary_dim: an even number in [2, head_dim={d}], got {rotary_dim!r}")
    if num_heads < 1 or kv_heads < 1:
        raise ValueError(f"num_heads, kv_heads: positive, got {num_heads}, {kv_heads}")
    if getattr(proj, "ndim", None) != 2:
        raise ValueError(f"proj: expected [B, C], got shape {getattr(proj, 'shape', None)}")
    b, c = proj.shape
    want = num_heads * d * (2 if gated else 1) + 2 * kv_heads * d
    if c != want:
        raise ValueError(
            f"proj: expected {want} columns (Hq {num_heads} x D {d}{' x 2 (gated)' if gated else ''}"
            f" + 2 x Hkv {kv_heads} x D), got {c}"
        )
    if not jnp.issubdtype(proj.dtype, jnp.floating):
        raise ValueError(f"proj: must be floating point, got {proj.dtype}")
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if getattr(w, "shape", None) != (d,):
            raise ValueError(f"{name}: expected shape ({d},), got {getattr(w, 'shape', None)}")
    for name, x in (("positions", positions), ("valid", valid)):
        if getattr(x, "shape", None) != (b,):
            raise ValueError(f"{name}: expected shape ({b},), got {getattr(x, 'shape', None)}")
    if jnp.dtype(kv_dtype) not in (jnp.dtype(F32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"kv_dtype: float32 or bfloat16, got {kv_dtype}")
    if getattr(arena, "ndim", None) != 2 or arena.dtype != jnp.uint32:
        raise ValueError(f"arena: expected uint32 [segments, words], got {arena.dtype}")
    if getattr(table, "ndim", None) != 2 or table.shape[1] != 2:
        raise ValueError(f"table: expected int [handles, 2], got {getattr(table, 'shape', None)}")
    if getattr(page_handles, "ndim", None) != 2 or page_handles.shape[0] != b:
        raise ValueError(
            f"page_handles: expected int [B={b}, MP], got {getattr(page_handles, 'shape', None)}"
        )
    if not isinstance(page_size, int | np.integer) or page_size < 1:
        raise ValueError(f"page_size: a positive int, got {page_size!r}")


def _kernel(
    x_ref, qw_ref, kw_ref, pos_ref, ok_ref, pt_ref, tab_ref, ar_ref, q_ref, out_ref, *,
    hq, hkv, d, rot, gated, theta, eps, layer, kv_offset, page_size, packed, kv_dtype,
):  # fmt: skip
    b, h = pl.program_id(0), pl.program_id(1)
    dt = x_ref.dtype
    half = d // 2
    lane = jax.lax.broadcasted_iota(jnp.int32, (half,), 0)
    idx = (2 * lane, 2 * lane + 1)  # the head's even and odd elements
    is_q = h < hq
    kvh = jnp.maximum(h - hq, 0)
    q_width = d * (2 if gated else 1)
    base = jnp.where(is_q, h * q_width, hq * q_width + kvh * d)
    pos = pos_ref[b]

    def rnd(v, dtype=dt):
        return v.astype(dtype).astype(F32)

    def normed_roped(w_ref):
        xs = [x_ref[b, base + i].astype(F32) for i in idx]
        inv = jax.lax.rsqrt(sum(jnp.sum(x * x) for x in xs) / d + eps)
        r2 = rot // 2
        out = []
        for i, x in zip(idx, xs, strict=True):
            y = rnd(x * inv * (1.0 + w_ref[i].astype(F32)))
            partner = jnp.where(i < r2, i + r2, i - r2)
            pj = jnp.where(i < rot, partner, i)  # in range; unused past the rotary dims
            xp = x_ref[b, base + pj].astype(F32)
            yp = rnd(xp * inv * (1.0 + w_ref[pj].astype(F32)))
            freq = jnp.exp(-(2.0 * jax.lax.rem(i, r2).astype(F32) / rot) * np.log(theta))
            ang = pos.astype(F32) * freq
            c, s = rnd(jnp.cos(ang)), rnd(jnp.sin(ang))
            roped = rnd(y * c + jnp.where(i < r2, -yp, yp) * s)
            out.append(jnp.where(i < rot, roped, y))
        return out

    @pl.when(is_q)
    def _query():
        for i, v in zip(idx, normed_roped(qw_ref), strict=True):
            q_ref[b, h * d + i] = v.astype(q_ref.dtype)

    @pl.when(~is_q)
    def _key_value():
        mp = pt_ref.shape[1]
        page = pos // page_size
        handle = jnp.where((page < mp) & (page >= 0), pt_ref[b, jnp.clip(page, 0, mp - 1)], -1)
        write = (ok_ref[b] != 0) & (handle >= 0)
        hnd = jnp.maximum(handle, 0)
        seg = tab_ref[hnd, 0]
        wph = half if packed else d  # words per head row
        token_words = hkv * wph
        row = tab_ref[hnd, 1] + kv_offset + jax.lax.rem(pos, page_size) * token_words + kvh * wph
        k_vals = normed_roped(kw_ref)
        v_vals = [x_ref[b, base + hkv * d + i].astype(F32) for i in idx]
        for blk, vals in ((2 * layer, k_vals), (2 * layer + 1, v_vals)):
            start = row + blk * page_size * token_words
            if packed:
                ev, od = (jax.lax.bitcast_convert_type(rnd(v, kv_dtype), jnp.uint32) for v in vals)
                words = (ev >> jnp.uint32(16)) | (od & jnp.uint32(HIGH_HALF))
                plt.store(
                    out_ref.at[seg, start + lane], words, mask=jnp.broadcast_to(write, (half,))
                )
            else:
                for i, v in zip(idx, vals, strict=True):
                    words = jax.lax.bitcast_convert_type(rnd(v, kv_dtype), jnp.uint32)
                    plt.store(
                        out_ref.at[seg, start + i], words, mask=jnp.broadcast_to(write, (half,))
                    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "num_heads", "kv_heads", "head_dim", "rotary_dim", "theta", "eps", "gated", "layer",
        "kv_offset", "page_size", "kv_dtype", "interpret",
    ),
)  # fmt: skip
def attention_decode_prep(
    proj, q_norm, k_norm, positions, valid, arena, table, page_handles, *, num_heads: int,
    kv_heads: int, head_dim: int, rotary_dim: int, theta: float, eps: float, gated: bool,
    layer: int, kv_offset: int, page_size: int, kv_dtype, interpret: bool = False,
):  # fmt: skip
    """``(q [B, Hq, D] in proj's dtype, arena)`` (module docstring): ``proj [B, C]`` the
    layer's fused projection output (one token a row), ``q_norm, k_norm [D]`` the head norms'
    weights, ``positions int [B]`` the token's position, ``valid int/bool [B]`` (0: write
    nothing), ``arena uint32 [segments, words]`` (aliased: updated in place), ``table int
    [handles, 2]``, ``page_handles int [B, MP]``. Raises ``ValueError`` before launching for
    inputs it cannot take."""
    check_prep(
        proj, q_norm, k_norm, positions, valid, arena, table, page_handles, num_heads=num_heads,
        kv_heads=kv_heads, head_dim=head_dim, rotary_dim=rotary_dim, gated=gated,
        kv_dtype=kv_dtype, page_size=page_size,
    )  # fmt: skip
    b = proj.shape[0]
    kernel = functools.partial(
        _kernel,
        hq=num_heads,
        hkv=kv_heads,
        d=head_dim,
        rot=rotary_dim,
        gated=gated,
        theta=float(theta),
        eps=float(eps),
        layer=layer,
        kv_offset=kv_offset,
        page_size=int(page_size),
        packed=jnp.dtype(kv_dtype) == jnp.dtype(jnp.bfloat16),
        kv_dtype=jnp.dtype(kv_dtype),
    )
    q, arena = pl.pallas_call(
        kernel,
        grid=(b, num_heads + kv_heads),
        in_specs=[whole()] * 8,
        out_specs=(whole(), whole()),
        out_shape=(
            jax.ShapeDtypeStruct((b, num_heads * head_dim), proj.dtype),
            jax.ShapeDtypeStruct(arena.shape, arena.dtype),
        ),
        input_output_aliases={7: 1},
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="attention_decode_prep",
    )(
        proj,
        q_norm,
        k_norm,
        positions.astype(jnp.int32),
        valid.astype(jnp.int32),
        page_handles.astype(jnp.int32),
        table.astype(jnp.int32),
        arena,
    )
    return q.reshape(b, num_heads, head_dim), arena
