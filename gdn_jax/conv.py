"""Depthwise causal short convolution (HF Qwen3-Next semantics) on sequences and on draft trees.

``x: [B, T, C]`` channels last, ``weight: [C, W]`` (HF's ``conv1d.weight[:, 0, :]``), no bias.
``conv_state: [B, W-1, C]`` holds the last ``W-1`` inputs, oldest first. Output at ``t``::

    y_t = act( sum_{j=0}^{W-1} weight[:, j] * x_{t - (W-1) + j} )

with inputs before the sequence taken from ``conv_state`` (zeros when none). On a tree, the window
of node ``n`` is ``n`` and its ``W-1`` nearest ancestors, continuing into ``conv_state`` above the
root (docs/design.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from gdn_jax._prep import as_arrays
from gdn_jax.tree_wy import _check_parents

ACTIVATIONS = {"silu": jax.nn.silu, None: lambda x: x}


def _check_conv(x, weight, conv_state, activation):
    if x.ndim != 3:
        raise ValueError(f"x: expected [B, T, C], got shape {x.shape}")
    b, _, c = x.shape
    if weight.ndim != 2 or weight.shape[0] != c:
        raise ValueError(f"weight: expected [C={c}, W], got shape {weight.shape}")
    w = weight.shape[1]
    if conv_state is not None and conv_state.shape != (b, w - 1, c):
        raise ValueError(
            f"conv_state: expected [B, W-1, C] = {(b, w - 1, c)}, got {conv_state.shape}"
        )
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: must be one of {list(ACTIVATIONS)}, got {activation!r}")
    return b, c, w


def _tap_sum(taps, weight: jax.Array) -> jax.Array:
    """``sum_j weight[:, j] * taps[j]`` in f32, the taps oldest first, each ``[..., C]``: one
    elementwise sum (an einsum over a stacked window axis makes XLA gather and transpose the
    windows, ~10x the bytes on a GPU)."""
    w32 = weight.astype(jnp.float32)
    acc = taps[0].astype(jnp.float32) * w32[:, 0]
    for j in range(1, len(taps)):
        acc = acc + taps[j].astype(jnp.float32) * w32[:, j]
    return acc


def causal_conv1d(
    x: Float[Array, "B T C"],
    weight: Float[Array, "C W"],
    conv_state: Float[Array, "B Wm1 C"] | None = None,
    *,
    activation: str | None = "silu",
) -> tuple[Float[Array, "B T C"], Float[Array, "B Wm1 C"]]:
    """Causal conv over a sequence (prefill, or several decode tokens at once).

    Returns ``(y [B, T, C] in x's dtype, new conv_state [B, W-1, C])``: the last ``W-1`` inputs of
    ``concat(conv_state, x)``.
    """
    x, weight, conv_state = as_arrays(x, weight, conv_state)
    _check_conv(x, weight, conv_state, activation)
    return _conv_xla(x, weight, conv_state, activation=activation)


@functools.partial(jax.jit, static_argnames=("activation",))
def _conv_xla(x, weight, conv_state, *, activation):
    b, t, c = x.shape
    w = weight.shape[1]
    if conv_state is None:
        conv_state = jnp.zeros((b, w - 1, c), x.dtype)
    full = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)  # [B, W-1+T, C]
    y = ACTIVATIONS[activation](_tap_sum([full[:, j : j + t] for j in range(w)], weight))
    # materialized, as the einsum's dot was: fused into its consumers, the same conv compiles
    # to different roundings in different programs (the arena and pooled engines must agree
    # bit for bit)
    return jax.lax.optimization_barrier(y.astype(x.dtype)), full[:, t:]


def causal_conv1d_update(
    x: Float[Array, "B C"],
    conv_state: Float[Array, "B Wm1 C"],
    weight: Float[Array, "C W"],
    *,
    activation: str | None = "silu",
) -> tuple[Float[Array, "B C"], Float[Array, "B Wm1 C"]]:
    """One decode step: ``(y [B, C], new conv_state)``."""
    if x.ndim != 2:
        raise ValueError(f"x: expected [B, C] for a single step, got shape {x.shape}")
    y, state = causal_conv1d(x[:, None], weight, conv_state, activation=activation)
    return y[:, 0], state


def _tree_ancestors(parents: jax.Array, steps: int) -> jax.Array:
    """int32 ``[steps, B, N]``: the ``d``-th ancestor of each node for ``d = 1..steps``.

    An entry ``-j`` (``j >= 1``) means ``j`` steps above the root: the ``j``-th most recent
    committed input. Padding nodes count as root children.
    """
    b, n = parents.shape
    rows = jnp.arange(b)[:, None]
    par = jnp.where(parents >= 0, parents, -1)
    out = []
    cur = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    for _ in range(steps):
        up = jnp.where(cur >= 0, par[rows, jnp.maximum(cur, 0)], cur - 1)
        out.append(up)
        cur = up
    return jnp.stack(out)


def tree_causal_conv1d(
    x: Float[Array, "B N C"],
    parents: Int[Array, "B N"],
    conv_state: Float[Array, "B Wm1 C"],
    weight: Float[Array, "C W"],
    *,
    activation: str | None = "silu",
) -> Float[Array, "B N C"]:
    """Causal conv of every draft node over its own root-to-node path (module docstring).

    ``y[n]`` equals the last output of :func:`causal_conv1d` run on ``x[path(n)]`` from
    ``conv_state``. Returns ``[B, N, C]`` in x's dtype.
    """
    x, parents, conv_state, weight = as_arrays(x, parents, conv_state, weight)
    b, c, w = _check_conv(x, weight, conv_state, activation)
    parents = _check_parents(parents, b, x.shape[1])
    return _tree_conv_xla(x, parents, conv_state, weight, activation=activation)


@functools.partial(jax.jit, static_argnames=("activation",))
def _tree_conv_xla(x, parents, conv_state, weight, *, activation):
    b, w = x.shape[0], weight.shape[1]
    anc = _tree_ancestors(parents, w - 1)  # [W-1, B, N], anc[d-1] = d-th ancestor
    rows = jnp.arange(b)[:, None]
    from_x = x[rows, jnp.maximum(anc, 0)]  # [W-1, B, N, C]
    from_state = conv_state.astype(x.dtype)[rows, jnp.clip(w - 1 + anc, 0, w - 2)]
    taps = jnp.where((anc >= 0)[..., None], from_x, from_state)
    # taps[d-1] multiplies weight[:, W-1-d]; the node itself multiplies weight[:, W-1].
    y = ACTIVATIONS[activation](_tap_sum([taps[w - 2 - j] for j in range(w - 1)] + [x], weight))
    return y.astype(x.dtype)


def tree_conv_commit(
    x: Float[Array, "B N C"],
    conv_state: Float[Array, "B Wm1 C"],
    path: Int[Array, "B D"],
    path_len: Int[Array, " B"],
) -> Float[Array, "B Wm1 C"]:
    """The conv state after the accepted chain: the last ``W-1`` inputs of
    ``concat(conv_state, x[path[:path_len]])``, topped up from the old state when the chain is
    shorter than ``W-1``."""
    x, conv_state, path, path_len = as_arrays(x, conv_state, path, path_len)
    b, wm1, c = conv_state.shape
    if x.ndim != 3 or x.shape[0] != b or x.shape[2] != c:
        raise ValueError(f"x: expected [B={b}, N, C={c}], got shape {x.shape}")
    if path.ndim != 2 or path.shape[0] != b or path_len.shape != (b,):
        raise ValueError(
            f"path/path_len: expected [B, D] and [B] with B={b}, got {path.shape}, {path_len.shape}"
        )
    return _conv_commit_xla(x, conv_state, path, path_len)


@jax.jit
def _conv_commit_xla(x, conv_state, path, path_len):
    b, wm1, _ = conv_state.shape
    n = x.shape[1]
    back = jnp.arange(wm1)[::-1]  # slot s holds the input `back[s]` steps before the newest
    m = path_len.astype(jnp.int32)[:, None]
    on_path = back[None, :] < m  # [B, W-1]
    pos = jnp.clip(m - 1 - back[None, :], 0, path.shape[1] - 1)
    node = jnp.clip(jnp.take_along_axis(path.astype(jnp.int32), pos, axis=1), 0, n - 1)
    rows = jnp.arange(b)[:, None]
    from_x = x[rows, node]
    from_state = conv_state.astype(x.dtype)[
        rows, jnp.clip(wm1 - 1 - (back[None, :] - m), 0, wm1 - 1)
    ]
    return jnp.where(on_path[..., None], from_x, from_state).astype(conv_state.dtype)
