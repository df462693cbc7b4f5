"""RMSNorms of Qwen3-Next / Qwen3.5: zero-centred ``(1 + w)`` and the gated one of the GDN output."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from gdn_jax.dispatch import pallas_op, resolve_impl


def _normalize(x: jax.Array, eps: float) -> jax.Array:
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def add_rms_norm(
    x: jax.Array, delta: jax.Array | None, weight: jax.Array, *, eps: float, impl: str = "auto"
) -> tuple[jax.Array, jax.Array]:
    """``(s, rmsnorm(s) * (1 + weight))`` with ``s = x + delta`` (``x`` itself when ``delta``
    is None) over the last axis, the norm in f32 cast back to ``s``'s dtype: a decoder's
    residual add and the next sub-block's norm. ``impl="pallas"``: one GPU kernel
    (:mod:`pallas_kernels.norm`; interpret mode off GPU) where XLA runs the add, a reduction
    and a scaling kernel; ``"auto"`` takes it on a GPU where ``x`` and ``delta`` share a dtype."""
    if delta is not None and delta.shape != x.shape:
        raise ValueError(f"delta: expected x's shape {x.shape}, got {delta.shape}")
    lead, h = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, h)
    d2 = None if delta is None else delta.reshape(-1, h)
    if resolve_impl(impl, "add_rms_norm", x2, d2, weight) != "xla":
        out = pallas_op("add_rms_norm")(x2, d2, weight, eps=eps)
        s, y = (x2, out) if delta is None else out
        return s.reshape(*lead, h), y.reshape(*lead, h)
    s = x if delta is None else x + delta
    y = _normalize(s, eps) * (1.0 + weight.astype(jnp.float32))
    return s, y.astype(s.dtype)


class RMSNorm(nnx.Module):
    """``rmsnorm(x) * (1 + w)`` in f32, cast back to x's dtype; ``w`` starts at zero.
    ``impl`` routes :func:`add_rms_norm` (``"auto"``: its GPU kernel on a GPU)."""

    def __init__(self, dim: int, *, eps: float, dtype, impl: str = "auto"):
        self.weight = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps
        self.impl = impl

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.add(x, None)[1]

    def add(self, x: jax.Array, delta: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        """``(x + delta, self(x + delta))`` in one kernel on a GPU (:func:`add_rms_norm`);
        ``delta=None``: ``(x, self(x))``."""
        return add_rms_norm(x, delta, self.weight[...], eps=self.eps, impl=self.impl)


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
