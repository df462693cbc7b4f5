"""The replay drafter: draft trees that contain the target's own greedy continuation with a
controlled probability, so that random-weight models accept drafts at a realistic rate.

Before a run, every request's greedy continuation is computed once by plain decoding (the
oracle pass, :func:`benchmarks.serving_load.run.oracle_pass`) and registered here with
:meth:`ReplayDrafter.register`. At a speculative step the drafter finds the request by its
prompt, checks that what it generated so far is the oracle's prefix (the *true path*), and
fills the engine's :class:`~serving.spec_trees.TreeBuilder` level by level:

- At the true-path node of depth ``d - 1`` the true next token (the oracle's) gets rank 1
  among the node's candidates with probability ``p_d = p_1 * decay^(d - 1)``; otherwise its
  rank is ``1 + G`` with ``G ~ Geometric(sibling_hit)`` (``sibling_hit = 0`` keeps it out of
  the candidates). A node with ``k`` children contains it when its rank is at most ``k``, so
  a chain sees only ``p_d`` and a wider tree also catches lower ranks, as with a real drafter.
- Every other candidate is a random token (never the true token), and every node off the true
  path (or after a true token was left out, or once the request diverged from its oracle)
  gets random children.

Candidates carry the drafter probabilities ``q_j ~ 2^-j`` by rank ``j``, so dynamic
(``budget``) trees keep the most probable nodes as with a model drafter.

Greedy verification then accepts exactly the true-path prefix that the tree holds, so every
method emits the plain decoding's tokens. The draws are keyed by ``(seed, request key,
tokens generated so far)``: the true token's rank at each depth is drawn before any sibling,
so every method sees the same ranks for the same request and position, whatever its tree
shape. :func:`calibrate` picks ``p_1`` so that a chain of ``depth`` drafts accepts a mean of
``target`` tokens per step.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from serving.drafters import NgramDrafter
from serving.spec_trees import TreeBuilder

KEY_TOKENS = 8  # prompt tokens that index the registry (prompts are at least this long)
MAX_DEPTH = 256  # rank draws per step (deeper trees than this are not supported)


@dataclasses.dataclass(frozen=True)
class ReplayParams:
    """``p_1``: rank-1 probability of the true token at depth 1; ``decay``: its factor per
    further depth; ``sibling_hit``: success probability of the geometric rank offset when the
    true token is not ranked first (0: never among the candidates then); ``seed``."""

    p1: float
    decay: float = 0.9
    sibling_hit: float = 0.25
    seed: int = 0
    force: bool = False  # the target follows the oracle (ReplayDrafter.forced_targets)

    def p(self, depth: int) -> float:
        return min(1.0, self.p1 * self.decay ** (depth - 1))


def chain_acceptance(p1: float, decay: float, depth: int) -> float:
    """Expected tokens per step of a chain of ``depth`` drafts: ``1 + sum_k prod_{d<=k} p_d``
    (the bonus token plus the accepted prefix)."""
    total, run = 1.0, 1.0
    for d in range(1, depth + 1):
        run *= min(1.0, p1 * decay ** (d - 1))
        total += run
    return total


def calibrate(target: float = 3.0, depth: int = 4, decay: float = 0.9) -> float:
    """``p_1`` for which a chain of ``depth`` drafts accepts ``target`` tokens per step on
    average (bisection on :func:`chain_acceptance`)."""
    if not 1.0 <= target <= chain_acceptance(1.0, decay, depth):
        raise ValueError(f"target: {target} is out of reach for depth {depth}, decay {decay}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chain_acceptance(mid, decay, depth) < target else (lo, mid)
    return (lo + hi) / 2


@dataclasses.dataclass
class _Entry:
    key: int
    prompt: np.ndarray
    oracle: np.ndarray


class ReplayDrafter(NgramDrafter):
    """Host-side drafter with :class:`NgramDrafter`'s interface (the engine's device program
    verifies the trees it builds). Install it on an ``LLM`` built with
    ``SpecConfig(method="ngram", ...)`` by ``llm.engine.drafter = drafter``."""

    def __init__(self, vocab: int, params: ReplayParams):
        super().__init__(ngram_max=1, vocab=vocab)
        self.params = params
        self._index: dict[tuple[int, ...], list[_Entry]] = {}
        self.steps = 0
        self.off_path_steps = 0  # steps of requests whose output left their oracle
        self.host_s = 0.0  # seconds spent drafting (left out of the benchmark's step clock)

    def register(self, key: int, prompt, oracle) -> None:
        """Request ``key``'s prompt and its greedy continuation (the oracle)."""
        prompt = np.asarray(prompt, np.int64)
        if prompt.size < KEY_TOKENS:
            raise ValueError(f"prompt: replay needs at least {KEY_TOKENS} tokens")
        entry = _Entry(int(key), prompt, np.asarray(oracle, np.int64))
        self._index.setdefault(tuple(prompt[:KEY_TOKENS].tolist()), []).append(entry)

    def _find(self, ctx: np.ndarray) -> _Entry | None:
        for e in self._index.get(tuple(ctx[:KEY_TOKENS].tolist()), ()):
            n = e.prompt.size
            if ctx.size > n and np.array_equal(ctx[:n], e.prompt):
                return e
        return None

    def draft(self, contexts: list[np.ndarray], builders: list[TreeBuilder], **_) -> None:
        t0 = time.perf_counter()
        for ctx, tb in zip(contexts, builders, strict=True):
            self._fill(np.asarray(ctx, np.int64), tb)
            tb.finish()
        self.host_s += time.perf_counter() - t0

    def _fill(self, ctx: np.ndarray, tb: TreeBuilder) -> None:
        self.steps += 1
        prm = self.params
        entry = self._find(ctx)
        key, generated, truth = 0, 0, None
        if entry is not None:
            key, generated = entry.key, ctx.size - entry.prompt.size
            # forced: the oracle by position (the first token is the model's own, from
            # prefill; every later one is the oracle's, since the target is made to follow it)
            if prm.force or np.array_equal(ctx[entry.prompt.size :], entry.oracle[:generated]):
                truth = entry.oracle[generated:]
        if truth is None:
            self.off_path_steps += 1
            truth = np.zeros(0, np.int64)
        tb.data[0] = truth  # the root's payload: the true continuation (forced_targets)
        # ranks first (a fixed number of draws), then siblings: same ranks for every tree shape
        ranks_rng = np.random.default_rng([prm.seed, key, generated, 0])
        u = ranks_rng.random(MAX_DEPTH)
        offset = (
            ranks_rng.geometric(prm.sibling_hit, MAX_DEPTH)
            if prm.sibling_hit > 0
            else np.full(MAX_DEPTH, 1 << 30)
        )
        sib = np.random.default_rng([prm.seed, key, generated, 1])
        level = 0
        while nodes := tb.frontier(level):  # (dynamic trees are pruned, renumbered, here)
            depth = level + 1
            on_path = self._true_nodes(tb, truth)
            for node in nodes:
                k = tb.width(node)
                true_tok = int(truth[depth - 1]) if depth - 1 < truth.size else -1
                rank = None
                if node in on_path and true_tok >= 0:
                    rank = 1 if u[depth - 1] < prm.p(depth) else 1 + int(offset[depth - 1])
                    if rank > k:
                        rank = None
                cands = self._random_tokens(sib, k, exclude=true_tok)
                if rank is not None:
                    cands.insert(rank - 1, true_tok)
                    cands = cands[:k]
                q = 0.5 ** np.arange(1, len(cands) + 1)
                tb.propose(node, cands, q / q.sum())
            level += 1

    def forced_targets(self, builders: list[TreeBuilder], b: int, n: int) -> np.ndarray | None:
        """With ``force``: ``int32 [b, n]``, at each node on the true path of each tree the
        oracle's next token, ``-1`` elsewhere (the engine hands it to the device program's
        acceptance in place of the target's argmax, :func:`serving.spec_device.accept`; the
        target's logits are computed all the same). ``None`` without ``force``."""
        if not self.params.force:
            return None
        out = np.full((b, n), -1, np.int32)
        for i, tb in enumerate(builders):
            truth = tb.data[0]
            if truth is None:
                continue
            for node in self._true_nodes(tb, truth):
                d = tb.depth[node]
                if d < truth.size:
                    out[i, node] = truth[d]
        return out

    def _random_tokens(self, rng: np.random.Generator, k: int, exclude: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            t = int(rng.integers(0, self.vocab))
            if t != exclude and t not in out:
                out.append(t)
        return out

    @staticmethod
    def _true_nodes(tb: TreeBuilder, truth: np.ndarray) -> set[int]:
        """Nodes whose path from the root spells a prefix of ``truth``."""
        good = {0}
        for n in range(1, len(tb)):
            d = tb.depth[n]
            if tb.parents[n] in good and d - 1 < truth.size and tb.tokens[n] == truth[d - 1]:
                good.add(n)
        return good
