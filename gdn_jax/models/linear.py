"""A bias-free linear layer stored in HF layout (``weight: [out, in]``) so loading is a copy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def matmul_precision(dtype) -> jax.lax.Precision:
    """HIGHEST for f32 (parity with a float32 reference; GPU's default dot is TF32), else
    DEFAULT."""
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else jax.lax.Precision.DEFAULT


def normal_init(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, std: float = 0.02) -> jax.Array:
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class Linear(nnx.Module):
    """``y = x W^T`` with ``W: [out, in]``."""

    def __init__(self, in_features: int, out_features: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(normal_init(rngs, (out_features, in_features), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.weight[...]
        return jnp.einsum(
            "...i,oi->...o", x.astype(w.dtype), w, precision=matmul_precision(w.dtype)
        )
