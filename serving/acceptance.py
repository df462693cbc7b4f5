"""Choosing the next tokens from target logits: plain sampling, greedy tree acceptance, and
lossless recursive rejection sampling over a draft tree's siblings.

Recursive rejection sampling at a node with target distribution ``p`` and children
``x_1..x_k`` drawn from ``q`` without replacement: for ``i = 1..k`` with ``q_i`` = ``q`` with
``x_1..x_{i-1}`` removed and renormalised, accept ``x_i`` with probability
``min(1, p_i(x_i) / q_i(x_i))``; on rejection ``p_{i+1} = norm(max(p_i - q_i, 0))``. If all are
rejected, sample from ``p_{k+1}``. The emitted token is distributed exactly as ``p``. Fixed
proposals (n-gram) are the case ``q_i = delta(x_i)``: accept with ``p_i(x_i)``, then remove it.
"""

from __future__ import annotations

import numpy as np

from serving.params import SamplingParams
from serving.spec_trees import TreeBuilder


def target_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """``softmax(logits / T)`` with top-k and top-p applied, renormalised: ``[..., V]`` f64."""
    x = np.asarray(logits, np.float64) / params.temperature
    x = x - x.max(axis=-1, keepdims=True)
    p = np.exp(x)
    p /= p.sum(axis=-1, keepdims=True)
    v = p.shape[-1]
    if 0 < params.top_k < v:
        kth = -np.sort(-p, axis=-1)[..., params.top_k - 1 : params.top_k]
        p = np.where(p >= kth, p, 0.0)
    if params.top_p < 1.0:
        order = np.argsort(-p, axis=-1, kind="stable")
        sp = np.take_along_axis(p, order, axis=-1)
        before = np.cumsum(sp, axis=-1) - sp
        keep_sorted = before < params.top_p * sp.sum(axis=-1, keepdims=True)
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        p = np.where(keep, p, 0.0)
    return p / p.sum(axis=-1, keepdims=True)


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    return int(rng.choice(p.shape[-1], p=p / p.sum()))


def greedy_accept(tree: TreeBuilder, argmax: np.ndarray) -> tuple[list[int], int]:
    """``(accepted path of node ids from the root, next token)``: follow the child whose token
    is the target's argmax at the current node while there is one."""
    node, path = 0, [0]
    while True:
        want = int(argmax[node])
        nxt = [c for c in tree.children(node) if tree.tokens[c] == want]
        if not nxt:
            return path, want
        node = nxt[0]
        path.append(node)


def rejection_accept(
    tree: TreeBuilder, probs: np.ndarray, rng: np.random.Generator
) -> tuple[list[int], int]:
    """Lossless multi-draft acceptance (recursive rejection sampling over siblings)."""
    node, path = 0, [0]
    while True:
        p = np.array(probs[node], np.float64)
        q_full = tree.q[node]
        removed = np.zeros(p.shape[0], bool)
        accepted = None
        for child in tree.children(node):
            x = tree.tokens[child]
            if q_full is None:
                q = np.zeros_like(p)
                q[x] = 1.0
            else:
                q = np.where(removed, 0.0, q_full)
                q = q / q.sum()
            if q[x] > 0 and rng.random() < min(1.0, p[x] / q[x]):
                accepted = child
                break
            residual = np.maximum(p - q, 0.0)
            total = residual.sum()
            p = residual / total if total > 0 else p
            removed[x] = True
        if accepted is None:
            return path, sample(p, rng)
        node = accepted
        path.append(node)
