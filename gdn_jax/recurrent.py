"""The gated delta rule as a plain recurrence over time (``lax.scan``): decode and reference.

``impl="pallas_tpu"`` runs the TPU decode kernel (:mod:`pallas_kernels.tpu.decode`: a token loop
on the state in VMEM, TPU interpret mode off TPU), which ``"auto"`` takes on a TPU; every other
backend runs the scan.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from gdn_jax._prep import (
    HIGHEST,
    as_arrays,
    check_rule_inputs,
    group_heads,
    prepare_qk,
    ungroup_heads,
)
from gdn_jax.dispatch import pallas_op, resolve_impl


def recurrent_gated_delta_rule(
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
    impl: str = "auto",
) -> tuple[Float[Array, "B T Hv V"], Float[Array, "B Hv K V"] | None]:
    """Runs the gated delta rule token by token.

    For each token ``t`` and value head ``h`` (key head ``h // (Hv // Hk)``)::

        S = exp(g_t) S;   u_t = beta_t (v_t - S^T k_t);   S = S + k_t u_t^T;   o_t = S^T q_t

    with ``q`` scaled by ``scale`` (default ``K ** -0.5``) after the optional l2norm of q and k.
    Math in f32; ``o`` has the dtype of ``v``. ``initial_state`` defaults to zeros. ``impl``:
    ``"auto"``, ``"xla"`` or ``"pallas_tpu"`` (module docstring; no GPU kernel takes ``"pallas"``).

    Returns ``(o [B, T, Hv, V], S_T [B, Hv, K, V] f32 or None)``.
    """
    q, k, v, g, beta, initial_state = as_arrays(q, k, v, g, beta, initial_state)
    check_rule_inputs(q, k, v, g, beta, initial_state)
    kernel = resolve_impl(impl, "recurrent_gated_delta_rule", q, k, v)
    if kernel != "xla":
        o, s = pallas_op("recurrent_gated_delta_rule", kernel)(
            q, k, v, g, beta, initial_state, scale=scale, use_qk_l2norm=use_qk_l2norm
        )
        return o, (s if output_final_state else None)
    return _recurrent_xla(
        q,
        k,
        v,
        g,
        beta,
        initial_state,
        scale=scale,
        use_qk_l2norm=use_qk_l2norm,
        output_final_state=output_final_state,
    )


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "output_final_state"))
def _recurrent_xla(q, k, v, g, beta, initial_state, *, scale, use_qk_l2norm, output_final_state):
    b, _, hk, dk = k.shape
    hv, dv = v.shape[2:]
    qf, kf = prepare_qk(q, k, scale=scale, use_qk_l2norm=use_qk_l2norm)
    if initial_state is None:
        s0 = jnp.zeros((b, hv, dk, dv), jnp.float32)
    else:
        s0 = initial_state.astype(jnp.float32)
    # Time-major, value heads grouped under their key head: [T, B, Hk, G, ...].
    vg = group_heads(jnp.moveaxis(v.astype(jnp.float32), 1, 0), hk, 2)
    gg = group_heads(jnp.moveaxis(g.astype(jnp.float32), 1, 0), hk, 2)
    bg = group_heads(jnp.moveaxis(beta.astype(jnp.float32), 1, 0), hk, 2)
    qt = jnp.moveaxis(qf, 1, 0)
    kt = jnp.moveaxis(kf, 1, 0)

    def step(s, xs):
        q_t, k_t, v_t, g_t, b_t = xs
        s = s * jnp.exp(g_t)[..., None, None]
        kv = jnp.einsum("bhk,bhgkv->bhgv", k_t, s, precision=HIGHEST)
        u = b_t[..., None] * (v_t - kv)
        s = s + k_t[:, :, None, :, None] * u[:, :, :, None, :]
        o = jnp.einsum("bhk,bhgkv->bhgv", q_t, s, precision=HIGHEST)
        return s, o

    s_final, o = jax.lax.scan(step, group_heads(s0, hk, 1), (qt, kt, vg, gg, bg))
    o = jnp.moveaxis(ungroup_heads(o, 2), 0, 1).astype(v.dtype)
    return o, (ungroup_heads(s_final, 1) if output_final_state else None)
