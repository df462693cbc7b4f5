"""The SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

from __future__ import annotations

import jax
from flax import nnx

from gdn_jax.models.linear import Linear


class MLP(nnx.Module):
    def __init__(self, hidden: int, intermediate: int, *, dtype, rngs: nnx.Rngs):
        self.gate_proj = Linear(hidden, intermediate, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(hidden, intermediate, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(intermediate, hidden, dtype=dtype, rngs=rngs)
        self.fused_in = nnx.data(None)  # gate_proj, up_proj as one matmul (gdn_jax.models.fused)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.fused_in is not None:
            gate, up = self.fused_in(x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(jax.nn.silu(gate) * up)
