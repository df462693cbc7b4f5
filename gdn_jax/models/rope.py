"""Partial rotary position embedding (rotate-half convention on the first ``rotary_dim`` dims).

For position ``p`` and ``f_i = theta^(-2i / R)``, ``i < R / 2``: the first ``R`` dims of each head
are ``x * cos + rotate_half(x) * sin`` with ``cos = cos(p [f, f])``; the rest pass through.
Qwen3.5's multimodal rope reduces to this for text, where all three position axes are equal.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def apply_rope(x: jax.Array, positions: jax.Array, *, rotary_dim: int, theta: float) -> jax.Array:
    """``x: [B, T, H, D]``, ``positions: int [B, T]``; returns x's dtype."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, R/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [B, T, 1, R]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    return jnp.concatenate([rot * cos + rotated * sin, rest], axis=-1)
