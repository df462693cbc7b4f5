"""Draft trees built level by level on the host, then padded to the engine's static size.

Node 0 is the root: the last sampled token, not yet in the cache. Each level expands some
frontier nodes with children picked from the drafter's distribution ``q`` at that node: the
``k`` most likely (greedy) or ``k`` draws without replacement (Gumbel top-k, when sampling;
what lossless recursive rejection sampling over siblings assumes, see ``acceptance.py``).

- static tree ``(b_1, b_2, ...)``: every node at depth ``d`` gets ``b_{d+1}`` children;
- dynamic tree of ``budget`` nodes: at each depth the ``branch`` frontier nodes with the highest
  cumulative draft log-probability get ``branch`` children each; greedy decoding then keeps the
  ``budget`` nodes of highest cumulative probability (ancestor-closed, since it only falls
  along a path). Trees of fixed proposals rank their nodes by a float32 sum along the path of
  each proposal's rank (by default its log-probability); the n-gram drafter's ranks are
  :func:`log_share` of its counts, which the device's builder
  (:func:`serving.spec_device.ngram_budget_tree`) forms bit for bit, so both rank tied nodes
  alike. When sampling, nothing is pruned after the draws (pruning on the drawn tokens'
  probabilities would bias the sibling test), so the expansion stops at ``budget`` nodes.
"""

from __future__ import annotations

import numpy as np

from serving.params import SpecConfig

PAD_PARENT = -2


def log_share(count, total) -> np.ndarray:
    """``log(count / total)`` as float32 ``log(count) - log(total)``, each log rounded to
    float32 first: integer tables the host and the device form alike (no division, whose
    rounding differs between XLA's backends)."""
    logs = lambda x: np.log(np.asarray(x, np.float64)).astype(np.float32)
    return logs(count) - logs(total)


def _pick(q: np.ndarray, k: int, rng: np.random.Generator | None) -> np.ndarray:
    """``k`` distinct tokens from ``q`` (fewer if it has fewer non-zero entries): the most
    likely (ties: the lower token first), or with ``rng`` ``k`` Gumbel top-k draws. Greedy
    picks sort only the support, so a sparse ``q`` over a large vocabulary costs one scan."""
    support = np.flatnonzero(q > 0)
    k = min(k, support.size)
    if k <= 0:
        return np.zeros(0, np.int64)
    if rng is None:
        return support[np.argsort(-q[support], kind="stable")[:k]]
    with np.errstate(divide="ignore"):
        score = np.log(q) + rng.gumbel(size=q.shape)
    return np.argsort(-score, kind="stable")[:k]


class TreeBuilder:
    """One request's draft tree under construction.

    ``q[n]`` (probability vector or ``None``) is the drafter's distribution at node ``n`` that
    its children were drawn from; ``None`` means the children are fixed proposals.
    """

    def __init__(self, root_token: int, spec: SpecConfig, rng: np.random.Generator | None):
        self.spec = spec
        self.rng = rng
        self.tokens = [int(root_token)]
        self.parents = [-1]
        self.depth = [0]
        self.logp = [0.0]
        # fixed proposals: the float32 sum of their ranks along the path ranks the nodes
        self.score = [np.float32(0.0)]
        self.fixed = False
        self.q: list[np.ndarray | None] = [None]
        self.data: list = [None]  # a drafter's per-node payload (the MTP hidden state)
        self.done = False

    def __len__(self) -> int:
        return len(self.tokens)

    def frontier(self, level: int) -> list[int]:
        """The nodes at depth ``level`` to expand next (empty: the tree is finished)."""
        spec = self.spec
        self._prune()
        if self.done or level >= spec.max_depth:
            return []
        nodes = [i for i, d in enumerate(self.depth) if d == level]
        if spec.tree is None:
            rank = self._rank()
            nodes = sorted(nodes, key=lambda i: (-rank[i], i))[: spec.branch]
        return nodes

    def _rank(self) -> list:
        """Each node's ranking value, higher first: its cumulative log-probability, or for a
        tree of fixed proposals the float32 sum of its path's proposal ranks."""
        return self.score if self.fixed else self.logp

    def room(self) -> int:
        limit = self.spec.num_nodes if self.spec.tree is not None else self.spec.budget
        if self.spec.tree is None and self.rng is None:
            limit = len(self.tokens) + self.spec.branch  # pruned to the budget after the level
        return max(0, limit - len(self.tokens))

    def width(self, node: int) -> int:
        spec = self.spec
        return spec.tree[self.depth[node]] if spec.tree is not None else spec.branch

    def expand(self, node: int, q: np.ndarray, *, proposals: bool = False) -> None:
        """Adds children of ``node`` from distribution ``q [V]`` (``proposals``: fixed
        candidates, e.g. n-gram counts, recorded with ``q = None``)."""
        k = min(self.width(node), self.room())
        rng = None if proposals else self.rng
        picks = _pick(q, k, rng)
        self.q[node] = None if (proposals or self.rng is None) else q
        self.fixed |= proposals
        self._add(node, picks, q[picks])

    def propose(self, node: int, tokens, probs, ranks=None) -> None:
        """Adds children of ``node`` from fixed candidates given sparsely: distinct
        ``tokens [C]`` with probabilities ``probs [C]`` (> 0; the mass of the drafter's
        distribution on them), the most probable first (ties: the lower token), as many as
        the node takes; no ``[V]`` vector. ``ranks [C]``: what each adds to its path's
        ranking sum (float32; default ``log(probs)``). ``expand(node, q, proposals=True)``
        with ``q`` zero off ``tokens`` adds the same children."""
        tokens = np.asarray(tokens, np.int64)
        probs = np.asarray(probs, np.float64)
        if tokens.shape != probs.shape or tokens.ndim != 1:
            raise ValueError(
                f"tokens, probs: one probability per token, got {tokens.shape}, {probs.shape}"
            )
        if np.unique(tokens).size != tokens.size or (probs <= 0).any():
            raise ValueError("tokens, probs: distinct tokens with positive probabilities")
        if ranks is not None and np.shape(ranks) != tokens.shape:
            raise ValueError(f"ranks: one per token, got {np.shape(ranks)} for {tokens.shape}")
        k = min(self.width(node), self.room())
        order = np.lexsort((tokens, -probs))[:k]
        self.q[node] = None
        self.fixed = True
        self._add(node, tokens[order], probs[order], None if ranks is None else ranks[order])

    def _add(self, node: int, picks: np.ndarray, probs: np.ndarray, ranks=None) -> None:
        with np.errstate(divide="ignore"):
            lq = np.log(probs)
        ranks = lq.astype(np.float32) if ranks is None else np.asarray(ranks, np.float32)
        for t, lp, r in zip(picks, lq, ranks, strict=True):
            self.tokens.append(int(t))
            self.parents.append(node)
            self.depth.append(self.depth[node] + 1)
            self.logp.append(self.logp[node] + float(lp))
            self.score.append(np.float32(self.score[node] + r))
            self.q.append(None)
            self.data.append(None)

    def finish(self) -> None:
        self._prune()
        self.done = True

    def _prune(self) -> None:
        """Greedy dynamic trees: keep the ``budget`` nodes of highest cumulative probability
        (after each level, so a drafter model never sees more than ``budget`` nodes)."""
        spec = self.spec
        if spec.tree is None and self.rng is None and len(self.tokens) > spec.budget:
            rank = self._rank()
            order = sorted(range(len(self.tokens)), key=lambda i: (-rank[i], self.depth[i], i))
            keep = sorted(order[: spec.budget], key=lambda i: (self.depth[i], i))
            new = {old: j for j, old in enumerate(keep)}
            self.tokens = [self.tokens[i] for i in keep]
            self.parents = [new[self.parents[i]] if self.parents[i] >= 0 else -1 for i in keep]
            self.depth = [self.depth[i] for i in keep]
            self.logp = [self.logp[i] for i in keep]
            self.score = [self.score[i] for i in keep]
            self.q = [self.q[i] for i in keep]
            self.data = [self.data[i] for i in keep]

    def children(self, node: int) -> list[int]:
        return [i for i, p in enumerate(self.parents) if p == node]

    def arrays(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``(tokens int32 [n], parents int32 [n])``, padded (token 0, parent -2)."""
        if len(self.tokens) > n:
            raise ValueError(f"n: tree has {len(self.tokens)} nodes, more than {n}")
        tokens = np.zeros(n, np.int32)
        parents = np.full(n, PAD_PARENT, np.int32)
        tokens[: len(self.tokens)] = self.tokens
        parents[: len(self.parents)] = self.parents
        return tokens, parents
