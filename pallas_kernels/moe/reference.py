"""Plain-JAX reference of the routed experts: the specification of ``small_m.py``,
``grouped.py`` and ``mgpu.py``, dense over all experts::

    c[m, e]   = sum_j w[m, j] [experts[m, j] == e]                  (combine weights, [M, E])
    y[m, e]   = down_e( silu(x[m] gate_e) * (x[m] up_e) )           (every expert, [M, E, H])
    out[m]    = sum_e c[m, e] y[m, e]

in f32 with ``HIGHEST`` dots. Ids outside ``[0, E)`` match no expert and contribute nothing.
Dense means ``E`` times the routed work: for tests at tiny shapes only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST


@jax.jit
def routed_experts_reference(x, weights, experts, gate, up, down):
    """f32 ``out [M, H]`` (module docstring): ``x [M, H]``, ``weights [M, k]``,
    ``experts int [M, k]``, ``gate, up [E, H, I]``, ``down [E, I, H]``."""
    num_experts = gate.shape[0]
    xf = x.astype(gate.dtype).astype(F32)
    g = jnp.einsum("mh,ehi->mei", xf, gate.astype(F32), precision=HIGHEST)
    u = jnp.einsum("mh,ehi->mei", xf, up.astype(F32), precision=HIGHEST)
    y = jnp.einsum("mei,eih->meh", jax.nn.silu(g) * u, down.astype(F32), precision=HIGHEST)
    onehot = experts[:, :, None] == jnp.arange(num_experts)[None, None, :]  # [M, k, E]
    c = jnp.sum(jnp.where(onehot, weights.astype(F32)[:, :, None], 0.0), axis=1)  # [M, E]
    return jnp.einsum("me,meh->mh", c, y, precision=HIGHEST)
