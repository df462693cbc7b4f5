"""Shared input handling for the gated delta rule ops: shape checks, q/k normalisation, grouping.

Shape letters follow docs/design.md: ``q, k: [B, T, Hk, K]``, ``v: [B, T, Hv, V]``,
``g, beta: [B, T, Hv]``, state ``S: [B, Hv, K, V]``. Value head ``h`` reads key head
``h // (Hv // Hk)``; the ops reshape value-head axes to ``(Hk, Hv // Hk)`` so that a key head is
broadcast over its group instead of being repeated in memory.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

HIGHEST = jax.lax.Precision.HIGHEST
L2NORM_EPS = 1e-6


def as_arrays(*xs: Any) -> tuple[Any, ...]:
    """``jnp.asarray`` of each argument, passing ``None`` through (host numpy in, jax out)."""
    return tuple(None if x is None else jnp.asarray(x) for x in xs)


def l2norm(x: jax.Array) -> jax.Array:
    """``x * rsqrt(sum(x * x, -1) + 1e-6)`` in f32 (the HF/fla ``use_qk_l2norm`` convention)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def prepare_qk(
    q: jax.Array | None, k: jax.Array, *, scale: float | None, use_qk_l2norm: bool
) -> tuple[jax.Array | None, jax.Array]:
    """Returns f32 ``(q * scale, k)`` after the optional l2norm; ``scale`` defaults to ``K**-0.5``."""
    kf = l2norm(k) if use_qk_l2norm else k.astype(jnp.float32)
    if q is None:
        return None, kf
    qf = l2norm(q) if use_qk_l2norm else q.astype(jnp.float32)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return qf * scale, kf


def group_heads(x: jax.Array, hk: int, axis: int) -> jax.Array:
    """Splits a value-head axis ``Hv`` into ``(Hk, Hv // Hk)`` at ``axis``."""
    shape = x.shape
    hv = shape[axis]
    return x.reshape(shape[:axis] + (hk, hv // hk) + shape[axis + 1 :])


def ungroup_heads(x: jax.Array, axis: int) -> jax.Array:
    """Merges the ``(Hk, G)`` axes at ``axis, axis + 1`` back into one ``Hv`` axis."""
    shape = x.shape
    return x.reshape(shape[:axis] + (shape[axis] * shape[axis + 1],) + shape[axis + 2 :])


def _fail(arg: str, rule: str) -> None:
    raise ValueError(f"{arg}: {rule}")


def check_rule_inputs(
    q: jax.Array | None,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array | None,
    *,
    time_name: str = "T",
    state_name: str = "initial_state",
    state_batch: int | None = None,
) -> tuple[int, int, int, int, int, int]:
    """Validates the shapes of a gated-delta-rule call; returns ``(B, T, Hk, Hv, K, V)``."""
    if k.ndim != 4:
        _fail("k", f"expected rank 4 [B, {time_name}, Hk, K], got shape {k.shape}")
    b, t, hk, dk = k.shape
    if q is not None and q.shape != k.shape:
        _fail("q", f"shape {q.shape} must equal k's shape {k.shape} [B, {time_name}, Hk, K]")
    if v.ndim != 4 or v.shape[:2] != (b, t):
        _fail("v", f"expected [B={b}, {time_name}={t}, Hv, V], got shape {v.shape}")
    hv, dv = v.shape[2], v.shape[3]
    if hv % hk != 0:
        _fail("v", f"value heads Hv={hv} must be a multiple of key heads Hk={hk}")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (b, t, hv):
            _fail(name, f"expected shape [B, {time_name}, Hv] = {(b, t, hv)}, got {x.shape}")
    if not jnp.issubdtype(k.dtype, jnp.floating) or not jnp.issubdtype(v.dtype, jnp.floating):
        _fail("k/v", f"must be floating point, got {k.dtype} and {v.dtype}")
    if state is not None:
        sb = b if state_batch is None else state_batch
        if state.shape != (sb, hv, dk, dv):
            _fail(
                state_name, f"expected shape [B, Hv, K, V] = {(sb, hv, dk, dv)}, got {state.shape}"
            )
    return b, t, hk, hv, dk, dv


def concrete(x: Any) -> np.ndarray | None:
    """The value of ``x`` as numpy when it is known on the host (not a tracer), else ``None``."""
    if isinstance(x, jax.core.Tracer):
        return None
    try:
        return np.asarray(x)
    except Exception:  # an abstract value that cannot be read on the host
        return None
