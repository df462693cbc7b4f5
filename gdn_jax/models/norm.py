"""RMSNorms of Qwen3-Next / Qwen3.5: zero-centred ``(1 + w)`` and the gated one of the GDN output."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def _normalize(x: jax.Array, eps: float) -> jax.Array:
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """``rmsnorm(x) * (1 + w)`` in f32, cast back to x's dtype; ``w`` starts at zero."""

    def __init__(self, dim: int, *, eps: float, dtype):
        self.weight = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        y = _normalize(x, self.eps) * (1.0 + self.weight[...].astype(jnp.float32))
        return y.astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """``(w * rmsnorm(o)) * silu(z)`` over the last axis (one value head), ``w`` starts at one.

    As in HF, the normalised ``o`` is cast to its dtype before the weight multiplies it.
    """

    def __init__(self, dim: int, *, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, o: jax.Array, z: jax.Array) -> jax.Array:
        w = self.weight[...]
        y = (w * _normalize(o, self.eps).astype(o.dtype)).astype(jnp.float32)
        return (y * jax.nn.silu(z.astype(jnp.float32))).astype(o.dtype)
