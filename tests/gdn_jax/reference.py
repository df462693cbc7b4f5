"""Float64 numpy references: the plain sequential recurrence, per token and along tree paths."""

from __future__ import annotations

import numpy as np


def l2norm64(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def prep64(q, k, scale=None, use_qk_l2norm=False):
    q = l2norm64(q) if use_qk_l2norm else np.asarray(q, np.float64)
    k = l2norm64(k) if use_qk_l2norm else np.asarray(k, np.float64)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return q * scale, k


def step64(s, q_t, k_t, v_t, g_t, b_t):
    """One token for one (batch, value head): ``s [K, V]``; returns ``(s, o)``."""
    s = np.exp(g_t) * s
    u = b_t * (v_t - s.T @ k_t)
    s = s + np.outer(k_t, u)
    return s, s.T @ q_t


def recurrent64(q, k, v, g, beta, s0=None, *, scale=None, use_qk_l2norm=False):
    """``o [B, T, Hv, V]``, ``S [B, Hv, K, V]`` in float64 by the token recurrence."""
    q, k = prep64(q, k, scale, use_qk_l2norm)
    v, g, beta = (np.asarray(x, np.float64) for x in (v, g, beta))
    b, t, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    grp = hv // hk
    s = np.zeros((b, hv, dk, dv)) if s0 is None else np.array(s0, np.float64)
    o = np.zeros((b, t, hv, dv))
    for bi in range(b):
        for h in range(hv):
            for ti in range(t):
                s[bi, h], o[bi, ti, h] = step64(
                    s[bi, h],
                    q[bi, ti, h // grp],
                    k[bi, ti, h // grp],
                    v[bi, ti, h],
                    g[bi, ti, h],
                    beta[bi, ti, h],
                )
    return o, s


def tree_paths(parents: np.ndarray) -> list[list[int]]:
    """Root-to-node paths of one tree (padding nodes, ``-2``, get an empty path)."""
    out = []
    for n, p in enumerate(parents):
        if p == -2:
            out.append([])
        else:
            out.append((out[p] if p >= 0 else []) + [n])
    return out


def tree64(q, k, v, g, beta, parents, s0, *, scale=None, use_qk_l2norm=False):
    """Per-node output and state, each by the sequential recurrence along ``path(n)``.

    Returns ``o [B, N, Hv, V]``, ``states [B, N, Hv, K, V]`` (zeros on padding nodes).
    """
    q, k = prep64(q, k, scale, use_qk_l2norm)
    v, g, beta = (np.asarray(x, np.float64) for x in (v, g, beta))
    parents = np.atleast_2d(np.asarray(parents))
    b, n, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    grp = hv // hk
    o = np.zeros((b, n, hv, dv))
    states = np.zeros((b, n, hv, dk, dv))
    for bi in range(b):
        for node, path in enumerate(tree_paths(parents[bi])):
            for h in range(hv):
                s = np.array(s0[bi, h], np.float64)
                for i in path:
                    s, out = step64(
                        s,
                        q[bi, i, h // grp],
                        k[bi, i, h // grp],
                        v[bi, i, h],
                        g[bi, i, h],
                        beta[bi, i, h],
                    )
                if path:
                    o[bi, node, h], states[bi, node, h] = out, s
    return o, states


def causal_conv64(x, weight, state=None, silu=True):
    """``y [B, T, C]`` of the depthwise causal conv over ``concat(state, x)`` in float64."""
    x = np.asarray(x, np.float64)
    w = np.asarray(weight, np.float64)
    b, t, c = x.shape
    width = w.shape[1]
    state = np.zeros((b, width - 1, c)) if state is None else np.asarray(state, np.float64)
    full = np.concatenate([state, x], 1)
    y = np.stack([(full[:, i : i + width] * w.T[None]).sum(1) for i in range(t)], 1)
    return y / (1 + np.exp(-y)) if silu else y


def rel_err(a, b) -> float:
    """``|a - b| / |b|`` in the Frobenius norm (relative norm error)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
