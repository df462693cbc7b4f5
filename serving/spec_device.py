"""Speculation on the device: draft, verify, accept and commit in one jitted program per step.

A speculative step of :class:`serving.engine.Engine` with a static tree and the arena cache
runs as one program (:class:`DeviceSpeculator`); the host sends each row's root token, handles
and sampling parameters, and receives only the emitted tokens ``[B, depth + 1]`` and their
counts (and, for the MTP drafter, the next step's hidden state). Inside the program:

1. **Draft** (static tree ``(b_1, ..., b_D)``, level-ordered: the children of node ``j`` of
   depth ``d`` are contiguous, in order): level ``d`` runs the drafter on the nodes of depth
   ``<= d`` (the draft model's tree verify over the partial tree, its cache only read) or on
   the frontier alone (the MTP head, from each parent's hidden state), and picks each frontier
   node's ``b_{d+1}`` children: the most likely tokens (greedy rows) or ``b_{d+1}`` draws
   without replacement from ``q = softmax(logits / T)`` (Gumbel top-k; sampled rows). The
   n-gram drafter's trees are prompt lookups in the rows' tokens, which the step takes as an
   input and returns with its emitted tokens appended (:func:`ngram_tree` for static trees,
   :func:`ngram_budget_tree` for budget trees); for trees the host builds (another host
   drafter in the n-gram one's place, e.g. a replay drafter) the program starts at 2.
2. **Verify** the whole tree with the target (tree WY or per-node snapshots), writing the tree
   state into the rows' scratch units exactly as the two-program path does.
3. **Accept** on the device: greedy rows follow the target's argmax; sampled rows run
   recursive rejection sampling over siblings (:mod:`serving.acceptance`; fixed proposals for
   n-gram trees) with the target distribution under each row's temperature, top-k and top-p.
   Random draws come from ``jax.random`` keys of ``(seed, request index, output position)``.
4. **Commit** the accepted path (GDN states and conv windows, the accepted nodes' K/V, lengths)
   and catch the draft model's cache up on the accepted tokens.

Every read of the arena by the verify precedes every write (:meth:`ArenaCache.flush`), so the
arena, donated, is updated in place.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdn_jax.models import steps
from serving import launch
from serving.arena_cache import ArenaCache
from serving.arena_spec import ArenaSpec
from serving.kernels import ArenaKernels
from serving.runner import (
    TABLE_DELTA_ROWS,
    pack_columns,
    snapshot_sink,
    split_table_delta,
    with_table_delta,
)
from serving.spec_trees import log_share

# the offsets of the random streams of a step (folded into each row's key)
_DRAFT_STREAM = 1 << 16
_PLAIN_DRAW = 1 << 20
_FINAL_DRAW = 63


@dataclasses.dataclass(frozen=True)
class StaticTree:
    """A static tree ``widths = (b_1, ..., b_D)`` in level order."""

    widths: tuple[int, ...]

    @property
    def depth(self) -> int:
        return len(self.widths)

    @functools.cached_property
    def level_offsets(self) -> tuple[int, ...]:
        """``off[d]``: the first node of depth ``d``; ``off[D + 1]`` is the node count."""
        off, count = [0, 1], 1
        for w in self.widths:
            count *= w
            off.append(off[-1] + count)
        return tuple(off)

    @property
    def num_nodes(self) -> int:
        return self.level_offsets[-1]

    @functools.cached_property
    def parents(self) -> np.ndarray:
        off, par = self.level_offsets, [-1]
        for d, w in enumerate(self.widths):
            for j in range(off[d + 1] - off[d]):
                par += [off[d] + j] * w
        return np.asarray(par, np.int32)


@dataclasses.dataclass(frozen=True)
class BudgetTree:
    """A dynamic tree of at most ``budget`` nodes (:class:`serving.spec_trees.TreeBuilder`'s
    rule, on the device): at each depth the ``branch`` frontier nodes of highest cumulative
    draft log-probability get ``branch`` children each; greedy rows keep the ``budget`` nodes
    of highest cumulative probability after every level, sampled rows stop adding nodes at
    ``budget``. Candidates live in fixed slots: the root, then ``branch * branch`` per depth
    (frontier rank ``j``, child ``c`` at ``1 + d * branch**2 + j * branch + c``), so slot order
    is the builder's insertion order."""

    budget: int
    depth: int
    branch: int

    @property
    def slots(self) -> int:
        return 1 + self.depth * self.branch**2

    @functools.cached_property
    def slot_depth(self) -> np.ndarray:
        return np.asarray([0] + [1 + i // self.branch**2 for i in range(self.slots - 1)])


def _compact(alive, values, n: int, fill):
    """The alive slots' ``values [B, C, ...]`` in slot order, packed into ``n`` rows (the rest
    ``fill``), and each slot's packed index (``n`` where dead)."""
    index = jnp.where(alive, jnp.cumsum(alive, axis=1) - 1, n)
    b = alive.shape[0]
    out = jnp.full((b, n + 1, *values.shape[2:]), fill, values.dtype)
    out = out.at[jnp.arange(b)[:, None], index].set(values)
    return out[:, :n], index


def _compact_tree(alive, tokens, parents, n: int):
    """The alive slots as a tree of ``n`` nodes: ``(tokens [B, n], parents [B, n]`` (packed
    ids; padding ``-2``), each slot's packed index)."""
    rows = jnp.arange(alive.shape[0])[:, None]
    toks, index = _compact(alive, tokens, n, 0)
    packed_parent = jnp.where(parents >= 0, index[rows, jnp.maximum(parents, 0)], -1)
    return toks, _compact(alive, packed_parent, n, -2)[0], index


_NO_TOKEN = np.iinfo(np.int32).max  # sorts after every token


def _continuations(text, total, ngram_max: int, width: int):
    """Prompt lookup on the device, :func:`serving.drafters.ngram_candidates` and the greedy pick
    of :class:`serving.spec_trees.TreeBuilder` for a batch of texts: ``text int32 [R, W]``
    whose first ``total [R]`` tokens count. For the longest suffix (up to ``ngram_max``
    tokens) that occurred earlier, the tokens that followed its earlier occurrences, the
    ``width`` most frequent (ties: the smaller token first). Returns ``(tokens [R, width],
    found bool [R, width], counts int32 [R, width], occurrences int32 [R])``: each token's
    count, and the suffix's occurrences (at least 1)."""
    r, w = text.shape
    pos = jnp.arange(w)[None, :]
    cand = jnp.full((r, w), _NO_TOKEN, jnp.int32)
    done = jnp.zeros((r,), bool)
    for n in range(ngram_max, 0, -1):
        # windows text[i : i + n] of text[:total - 1], against the last n tokens
        hit = pos <= (total - 1 - n)[:, None]
        for j in range(n):
            shifted = jnp.pad(text[:, j:], ((0, 0), (0, j)))
            suffix = jnp.take_along_axis(text, jnp.maximum(total - n + j, 0)[:, None], axis=1)
            hit &= shifted == suffix
        follow = jnp.pad(text[:, n:], ((0, 0), (0, n)))
        use = ~done & jnp.any(hit, axis=1)
        cand = jnp.where(use[:, None], jnp.where(hit, follow, _NO_TOKEN), cand)
        done |= use
    s = jnp.sort(cand, axis=1)
    start = jnp.concatenate([jnp.ones((r, 1), bool), s[:, 1:] != s[:, :-1]], axis=1)
    nxt = jnp.where(start, pos, w)  # each run's length: the next run's start minus its own
    nxt = jax.lax.cummin(jnp.concatenate([nxt[:, 1:], jnp.full((r, 1), w)], axis=1), axis=1,
                         reverse=True)  # fmt: skip
    count = jnp.where(start & (s != _NO_TOKEN), nxt - pos, 0)
    top, idx = jax.lax.top_k(count, width)  # equal counts: the lower index, the smaller token
    hits = jnp.maximum(jnp.sum(count, axis=1), 1)
    return jnp.take_along_axis(s, idx, axis=1), top > 0, top, hits


def ngram_tree(history, lengths, root, tree: StaticTree, ngram_max: int):
    """The n-gram drafter's static tree on the device, node for node the host's
    (:class:`serving.drafters.NgramDrafter` filling a :class:`serving.spec_trees.TreeBuilder`):
    ``history int32 [B, L]`` each row's tokens (its root at ``lengths``, the cache's length),
    each node's children the continuations of its context (the row's tokens, then the path
    from the root to the node). Nodes without continuations get no children; the tree is
    packed as the host pads it: ``(tokens [B, N], parents [B, N])``, parent ``-2`` past the
    end."""
    b, hl = history.shape
    off, depth = tree.level_offsets, tree.depth
    text = jnp.pad(history, ((0, 0), (0, depth)))
    n = tree.num_nodes
    tokens = jnp.zeros((b, n), jnp.int32).at[:, 0].set(root)
    alive = jnp.zeros((b, n), bool).at[:, 0].set(True)
    paths = jnp.zeros((b, 1, depth), jnp.int32)  # each frontier node's tokens after the root
    rows = jnp.arange(b)[:, None]
    for d, w in enumerate(tree.widths):
        lo, hi = off[d], off[d + 1]
        f = hi - lo
        ctx = jnp.broadcast_to(text[:, None], (b, f, hl + depth))
        at = (lengths + 1)[:, None, None] + jnp.arange(d)[None, None, :]
        ctx = ctx.at[rows[:, :, None], jnp.arange(f)[None, :, None], at].set(paths[:, :, :d])
        total = jnp.broadcast_to((lengths + 1 + d)[:, None], (b, f))
        kids, found, _, _ = _continuations(ctx.reshape(b * f, -1), total.reshape(-1), ngram_max, w)
        kids, found = kids.reshape(b, f * w), found.reshape(b, f * w)
        found &= jnp.repeat(alive[:, lo:hi], w, axis=1)
        tokens = tokens.at[:, off[d + 1] : off[d + 2]].set(jnp.where(found, kids, 0))
        alive = alive.at[:, off[d + 1] : off[d + 2]].set(found)
        paths = jnp.repeat(paths, w, axis=1).at[:, :, d].set(kids)
    parents = jnp.broadcast_to(jnp.asarray(tree.parents), (b, n))
    toks, par, _ = _compact_tree(alive, tokens, parents, n)
    return toks, par


def budget_prune(alive, score, n: int):
    """The ``n`` alive slots of highest ``score`` (ties: the lower slot, i.e. the lower depth,
    then insertion order), as :class:`serving.spec_trees.TreeBuilder` prunes a greedy
    dynamic tree."""
    order = jnp.argsort(jnp.where(alive, -score, jnp.inf), axis=1, stable=True)
    rank = jnp.argsort(order, axis=1, stable=True)
    return alive & (rank < n)


def ngram_budget_tree(history, lengths, root, bt: BudgetTree, ngram_max: int):
    """The n-gram drafter's dynamic tree on the device, as the host builds it for the
    one-program step (:class:`serving.drafters.NgramDrafter` filling a greedy
    :class:`serving.spec_trees.TreeBuilder`): level by level, the ``branch`` alive nodes of
    depth ``d`` with the highest cumulative log-probability each take up to ``branch``
    continuations of their context (probability: the continuation's share of the suffix's
    occurrences), then the ``budget`` nodes of highest cumulative probability stay. A node
    ranks by the float32 sum of :func:`serving.spec_trees.log_share` along its path (from a
    table of the counts' float32 logs), formed as the host's builder forms it, so the two
    rank tied nodes alike (ties: the lower depth, then insertion order). ``history int32 [B, L]`` as :func:`ngram_tree`'s; returns ``(tokens [B,
    N], parents [B, N])``, ``N = budget``, parent ``-2`` past the end."""
    b, hl = history.shape
    c, br, n, depth = bt.slots, bt.branch, bt.budget, bt.depth
    text = jnp.pad(history, ((0, 0), (0, depth)))
    rows = jnp.arange(b)[:, None]
    slot_depth = jnp.asarray(bt.slot_depth)[None, :]
    tokens = jnp.zeros((b, c), jnp.int32).at[:, 0].set(root)
    parents = jnp.full((b, c), -1, jnp.int32)  # slot ids
    # log(k) for the counts k = 1 .. W (a share's count and total), as the host forms them
    logs = jnp.asarray(log_share(np.arange(1, hl + depth + 1), 1))
    rank = jnp.zeros((b, c), jnp.float32)  # the sums along the paths
    alive = jnp.zeros((b, c), bool).at[:, 0].set(True)
    paths = jnp.zeros((b, c, depth), jnp.int32)  # each slot's tokens after the root
    for d in range(depth):
        alive = budget_prune(alive, rank, n)
        score = jnp.where(alive & (slot_depth == d), rank, -jnp.inf)
        top, front = jax.lax.top_k(score, br)  # [B, br]: frontier slots by rank
        front_ok = jnp.isfinite(top)
        fpaths = paths[rows, front]  # [B, br, depth]
        ctx = jnp.broadcast_to(text[:, None], (b, br, hl + depth))
        at = (lengths + 1)[:, None, None] + jnp.arange(d)[None, None, :]
        ctx = ctx.at[rows[:, :, None], jnp.arange(br)[None, :, None], at].set(fpaths[:, :, :d])
        total = jnp.broadcast_to((lengths + 1 + d)[:, None], (b, br))
        kids, found, count, hits = _continuations(
            ctx.reshape(b * br, -1), total.reshape(-1), ngram_max, br
        )
        kids, found, count = (x.reshape(b, br, br) for x in (kids, found, count))
        share = logs[jnp.maximum(count, 1) - 1] - logs[hits.reshape(b, br, 1) - 1]
        ok = front_ok[..., None] & found
        lo = 1 + d * br * br
        sl = slice(lo, lo + br * br)
        tokens = tokens.at[:, sl].set(jnp.where(ok, kids, 0).reshape(b, -1))
        parents = parents.at[:, sl].set(jnp.repeat(front, br, axis=1))
        child = rank[rows, front][..., None] + share
        rank = rank.at[:, sl].set(child.reshape(b, -1))
        alive = alive.at[:, sl].set(ok.reshape(b, -1))
        paths = paths.at[:, sl].set(
            jnp.repeat(fpaths, br, axis=1).at[:, :, d].set(kids.reshape(b, -1))
        )
    alive = budget_prune(alive, rank, n)
    toks, par, _ = _compact_tree(alive, tokens, parents, n)
    return toks, par


def append_history(history, lengths, out, count):
    """``history`` with each row's emitted tokens ``out [B, depth + 1]`` (the first ``count``)
    written after its root (position ``lengths``), so that the last one, the next root, sits
    at ``lengths + count``; writes past the end are dropped."""
    b, d1 = out.shape
    at = (lengths + 1)[:, None] + jnp.arange(d1)[None, :]
    at = jnp.where(jnp.arange(d1)[None, :] < count[:, None], at, history.shape[1])
    return history.at[jnp.arange(b)[:, None], at].set(out, mode="drop")


def target_probs(logits, temperature, top_k, top_p):
    """``softmax(logits / T)`` restricted to the ``top_k`` most likely tokens and the smallest
    set of mass ``>= top_p``, renormalised (:func:`serving.acceptance.target_probs` on the
    device): ``logits [B, V]``, per-row ``temperature, top_k, top_p [B]`` (``T = 0``: treated
    as 1; greedy rows do not use the result)."""
    v = logits.shape[-1]
    t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    p = jax.nn.softmax(logits.astype(jnp.float32) / t, axis=-1)
    order = jnp.argsort(-p, axis=-1, stable=True)
    sp = jnp.take_along_axis(p, order, axis=-1)
    k = jnp.where((top_k > 0) & (top_k < v), top_k, v)
    kth = jnp.take_along_axis(sp, (k - 1)[:, None], axis=-1)
    keep_k = p >= kth
    sp = jnp.where(sp >= kth, sp, 0.0)  # top-p over what top-k kept
    before = jnp.cumsum(sp, axis=-1) - sp
    keep_sorted = before < top_p[:, None] * jnp.sum(sp, axis=-1, keepdims=True)
    inverse = jnp.argsort(order, axis=-1)
    keep_p = jnp.take_along_axis(keep_sorted, inverse, axis=-1) | (top_p[:, None] >= 1.0)
    p = jnp.where(keep_k & keep_p, p, 0.0)
    return p / jnp.sum(p, axis=-1, keepdims=True)


def row_keys(seeds):
    """One key per row from ``seeds uint32 [B, 3]`` = ``(seed, request index, position)``."""

    def one(s):
        key = jax.random.key(s[0])
        return jax.random.fold_in(jax.random.fold_in(key, s[1]), s[2])

    return jax.vmap(one)(seeds)


@jax.jit
def sample_rows(logits, seeds, temperature, top_k, top_p):
    """Each row's next token on the device: the argmax for greedy rows (``temperature == 0``),
    else a draw from :func:`target_probs` with the row's key (``seeds uint32 [B, 3]`` =
    ``(seed, request index, position)``): ``logits [B, V]`` -> ``int32 [B]``. Plain decoding
    and a request's first token take it, so only ``[B]`` tokens leave the device."""
    keys = _fold(row_keys(seeds), _PLAIN_DRAW)
    p = target_probs(logits, temperature, top_k, top_p)
    drawn = jax.vmap(lambda k, pr: jax.random.categorical(k, jnp.log(pr)))(keys, p)
    return jnp.where(temperature > 0, drawn, jnp.argmax(logits, axis=-1)).astype(jnp.int32)


def _fold(keys, stream: int):
    return jax.vmap(lambda k: jax.random.fold_in(k, stream))(keys)


def pick_children(logits, width: int, temperature, keys, *, sampling: bool = True):
    """``width`` distinct children per frontier node from ``logits [B, F, V]``: the most likely
    tokens for greedy rows (``temperature == 0``), Gumbel top-k draws from ``softmax(logits /
    T)`` otherwise (``sampling=False``: every row is greedy). Returns ``int32 [B, F, width]``."""
    if not sampling:
        return jax.lax.top_k(logits, width)[1].astype(jnp.int32)
    t = jnp.where(temperature > 0, temperature, 1.0)[:, None, None]
    logq = jax.nn.log_softmax(logits.astype(jnp.float32) / t, axis=-1)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, logits.shape[1:], jnp.float32))(keys)
    score = jnp.where((temperature > 0)[:, None, None], logq + gumbel, logq)
    return jax.lax.top_k(score, width)[1].astype(jnp.int32)


def accept(
    tokens,
    parents,
    target_logits,
    draft_logits,
    *,
    depth: int,
    width: int,
    temperature,
    top_k,
    top_p,
    keys,
    sampling: bool = True,
    forced=None,
):
    """The accepted path and the next token of each row (:mod:`serving.acceptance` on the
    device).

    ``tokens, parents int32 [B, N]`` (padding nodes: parent ``-2``), ``target_logits [B, N,
    V]``, ``draft_logits [B, N, V]`` (each node's children were drawn from ``softmax(
    draft_logits[node] / T)``) or ``None`` (fixed proposals, e.g. n-gram); ``width``: most
    children of a node. Greedy rows follow the target's argmax; sampled rows run recursive
    rejection sampling over siblings (``sampling=False``: every row is greedy, and the
    program holds no sampling at all). ``forced int32 [B, N]``: a benchmark's stand-in for
    the target's choice at each node of greedy rows (``-1``: the target's argmax there), so
    that a model with random weights follows a replayed continuation (the logits are computed
    all the same). Returns ``(path int32 [B, depth + 1]`` (node ids, ``-1`` past the length),
    ``path_len int32 [B]``, ``next int32 [B])``."""
    b = tokens.shape[0]
    rows = jnp.arange(b)
    greedy = temperature <= 0
    argmax = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)
    if forced is not None:
        argmax = jnp.where(forced >= 0, forced, argmax)
    node = jnp.zeros(b, jnp.int32)
    live = jnp.ones(b, bool)
    path = jnp.full((b, depth + 1), -1, jnp.int32).at[:, 0].set(0)
    path_len = jnp.ones(b, jnp.int32)
    nxt = jnp.zeros(b, jnp.int32)
    for d in range(depth + 1):
        is_child = parents == node[:, None]  # [B, N]
        rank = jnp.cumsum(is_child, axis=1)
        # greedy: the child whose token is the argmax
        want = argmax[rows, node]
        match = is_child & (tokens == want[:, None])
        g_found = jnp.any(match, axis=1)
        g_child = jnp.argmax(match, axis=1).astype(jnp.int32)
        if not sampling:
            stop = live & ~g_found
            nxt = jnp.where(stop, want, nxt)
            go = live & g_found
            if d < depth:
                path = path.at[:, d + 1].set(jnp.where(go, g_child, -1))
            path_len = path_len + go.astype(jnp.int32)
            node = jnp.where(go, g_child, node)
            live = go
            continue
        # sampled: recursive rejection sampling over the siblings, in node order
        p = target_probs(target_logits[rows, node], temperature, top_k, top_p)
        v = p.shape[-1]
        if draft_logits is not None:
            t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
            q_full = jax.nn.softmax(draft_logits[rows, node].astype(jnp.float32) / t, axis=-1)
        removed = jnp.zeros((b, v), bool)
        s_found = jnp.zeros(b, bool)
        s_child = jnp.zeros(b, jnp.int32)
        for i in range(width):
            sel = is_child & (rank == i + 1)
            exists = jnp.any(sel, axis=1) & ~s_found
            c = jnp.argmax(sel, axis=1).astype(jnp.int32)
            x = tokens[rows, c]
            onehot = jax.nn.one_hot(x, v, dtype=jnp.float32)
            if draft_logits is None:
                q = onehot
            else:
                q = jnp.where(removed, 0.0, q_full)
                q = q / jnp.maximum(jnp.sum(q, axis=-1, keepdims=True), 1e-30)
            px, qx = p[rows, x], q[rows, x]
            u = jax.vmap(lambda k, s=d * 64 + i: jax.random.uniform(jax.random.fold_in(k, s)))(keys)
            ok = exists & (qx > 0) & (u < jnp.minimum(1.0, px / jnp.maximum(qx, 1e-30)))
            s_child = jnp.where(ok, c, s_child)
            s_found = s_found | ok
            rejected = exists & ~ok
            residual = jnp.maximum(p - q, 0.0)
            total = jnp.sum(residual, axis=-1, keepdims=True)
            p_next = jnp.where(total > 0, residual / jnp.maximum(total, 1e-30), p)
            p = jnp.where(rejected[:, None], p_next, p)
            removed = removed | (rejected[:, None] & (onehot > 0))
        final = jax.vmap(
            lambda k, pr, s=d * 64 + _FINAL_DRAW: jax.random.categorical(
                jax.random.fold_in(k, s), jnp.log(pr)
            )
        )(keys, p).astype(jnp.int32)
        found = jnp.where(greedy, g_found, s_found)
        child = jnp.where(greedy, g_child, s_child)
        stop = live & ~found
        nxt = jnp.where(stop, jnp.where(greedy, want, final), nxt)
        go = live & found
        if d < depth:
            path = path.at[:, d + 1].set(jnp.where(go, child, -1))
        path_len = path_len + go.astype(jnp.int32)
        node = jnp.where(go, child, node)
        live = go
    return path, path_len, nxt


def emitted(tokens, path, path_len, nxt):
    """The tokens a step emits, ``int32 [B, depth + 1]``: the accepted nodes' tokens after the
    root, then the next token; ``-1`` past ``path_len``."""
    d1 = path.shape[1]
    rows = jnp.arange(tokens.shape[0])[:, None]
    shifted = jnp.concatenate([path[:, 1:], jnp.full_like(path[:, :1], -1)], axis=1)
    accepted = tokens[rows, jnp.maximum(shifted, 0)]
    j = jnp.arange(d1)[None, :]
    out = jnp.where(j < (path_len - 1)[:, None], accepted, -1)
    return jnp.where(j == (path_len - 1)[:, None], nxt[:, None], out).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class ProgramKey:
    """What one device speculation program depends on besides its array inputs."""

    target: object  # the target's graphdef
    target_spec: ArenaSpec
    target_kernels: ArenaKernels
    commit_impl: str
    drafter: str  # "draft_model" | "mtp" | "ngram"
    draft: object  # the draft model's graphdef (draft_model) or None
    draft_spec: ArenaSpec | None
    draft_kernels: ArenaKernels | None
    tree: StaticTree | BudgetTree | None  # None: the host's trees
    width: int
    depth: int
    snapshot: bool
    sampling: bool  # False: every row of the batch is greedy
    nodes: int  # N: the tree's node slots (a budget tree's budget)
    table_rows: int = 0  # rows of handle-table changes a step applies (runner.TABLE_DELTA_ROWS)
    # the runners' cache builders: ArenaCache, or a multi-device placement
    make_target_cache: object = ArenaCache
    make_draft_cache: object = ArenaCache
    # steps of at most this many tree tokens run as CUDA graphs (serving.launch)
    graph_tokens: int | None = launch.DEFAULT_GRAPH_TOKENS
    ngram_max: int = 0  # the n-gram drafter's longest suffix (its static trees on the device)
    forced: bool = False  # host trees with forced target choices (accept's ``forced``)


@functools.cache
def _program(key: ProgramKey):
    tree = key.tree

    def target_cache(buf, table, handles, pages, lengths, *, defer):
        spec, kernels = key.target_spec, key.target_kernels
        return key.make_target_cache(
            buf, table, handles, pages, lengths, spec, kernels, defer=defer
        )

    def draft_cache(buf, table, handles, pages, lengths):
        spec, kernels = key.draft_spec, key.draft_kernels
        return key.make_draft_cache(buf, table, handles, pages, lengths, spec, kernels)

    def draft_tree(tstate, dstate, buf, table, handles, pages, lengths, root, hidden, temp, keys):
        """``(tokens [B, N], parents [B, N], draft logits [B, N, V])`` of the static tree."""
        b = root.shape[0]
        off = tree.level_offsets
        parents = jnp.asarray(tree.parents)
        tokens = jnp.zeros((b, tree.num_nodes), jnp.int32).at[:, 0].set(root)
        chunks = []
        if key.drafter == "draft_model":
            dm = nnx.merge(key.draft, dstate)
            cache = draft_cache(buf, table, handles, pages, lengths)
        else:
            tm = nnx.merge(key.target, tstate)
            node_hidden = hidden[:, None]  # [B, F, H]: the frontier's inputs
        for d, w in enumerate(tree.widths):
            lo, hi = off[d], off[d + 1]
            if key.drafter == "draft_model":
                logits = steps.verify_tree(dm, tokens[:, :hi], parents[:hi], cache)[0]
                front = logits[:, lo:hi]
            else:  # the MTP head on each frontier node alone (a one-token sequence)
                f = hi - lo
                x = tm.embed(tokens[:, lo:hi].reshape(b * f, 1))
                h = tm.mtp(x, node_hidden.reshape(b * f, 1, -1)).reshape(b, f, -1)
                front = tm.logits(h)
                node_hidden = jnp.repeat(h, w, axis=1)
            front = front.astype(jnp.float32)
            chunks.append(front)
            picks = pick_children(
                front, w, temp, _fold(keys, _DRAFT_STREAM + d), sampling=key.sampling
            )
            tokens = tokens.at[:, off[d + 1] : off[d + 2]].set(picks.reshape(b, -1))
        v = chunks[0].shape[-1]
        leaves = jnp.zeros((b, tree.num_nodes - off[-2], v), jnp.float32)
        draft_logits = jnp.concatenate([*chunks, leaves], axis=1)
        return tokens, jnp.broadcast_to(parents, (b, tree.num_nodes)), draft_logits

    def draft_budget(tstate, dstate, buf, table, handles, pages, lengths, root, hidden, temp, keys):
        """``(tokens [B, N], parents [B, N], draft logits [B, N, V])`` of the dynamic tree
        (:class:`BudgetTree`), ``N = budget``."""
        bt = tree
        b, c, br, n = root.shape[0], bt.slots, bt.branch, bt.budget
        rows = jnp.arange(b)[:, None]
        depth = jnp.asarray(bt.slot_depth)[None, :]
        sampled = temp > 0
        tokens = jnp.zeros((b, c), jnp.int32).at[:, 0].set(root)
        parents = jnp.full((b, c), -1, jnp.int32)  # slot ids
        logp = jnp.zeros((b, c), jnp.float32)
        alive = jnp.zeros((b, c), bool).at[:, 0].set(True)
        qlogits = None
        if key.drafter == "draft_model":
            dm = nnx.merge(key.draft, dstate)
            cache = draft_cache(buf, table, handles, pages, lengths)
        else:
            tm = nnx.merge(key.target, tstate)
            slot_hidden = jnp.zeros((b, c, hidden.shape[-1]), hidden.dtype).at[:, 0].set(hidden)

        def prune(alive):
            # greedy rows: the budget nodes of highest cumulative probability
            return jnp.where(sampled[:, None], alive, budget_prune(alive, logp, n))

        for d in range(bt.depth):
            alive = prune(alive)
            at_d = alive & (depth == d)
            score = jnp.where(at_d, logp, -jnp.inf)
            top, front = jax.lax.top_k(score, br)  # [B, br]: frontier slots by rank
            front_ok = jnp.isfinite(top)
            if key.drafter == "draft_model":
                toks_c, par_c, index = _compact_tree(alive, tokens, parents, n)
                logits = steps.verify_tree(dm, toks_c, par_c, cache)[0]
                front_logits = logits[rows, jnp.minimum(index[rows, front], n - 1)]
            else:  # the MTP head on each frontier node alone
                x = tm.embed(tokens[rows, front].reshape(b * br, 1))
                hin = slot_hidden[rows, front].reshape(b * br, 1, -1)
                h = tm.mtp(x, hin).reshape(b, br, -1)
                front_logits = tm.logits(h)
            front_logits = front_logits.astype(jnp.float32)
            if qlogits is None:
                qlogits = jnp.zeros((b, c, front_logits.shape[-1]), jnp.float32)
            qlogits = qlogits.at[rows, front].set(
                jnp.where(front_ok[..., None], front_logits, qlogits[rows, front])
            )
            picks = pick_children(
                front_logits, br, temp, _fold(keys, _DRAFT_STREAM + d), sampling=key.sampling
            )  # [B, br, br]
            t = jnp.where(sampled, temp, 1.0)[:, None, None]
            logq = jax.nn.log_softmax(front_logits / t, axis=-1)
            child_logq = jnp.take_along_axis(logq, picks, axis=-1)
            # sampled rows: stop at budget nodes (frontier node j gets what is left, in order)
            room = n - jnp.sum(alive, axis=1)
            j = jnp.arange(br)[None, :, None]
            k = jnp.where(sampled[:, None, None], jnp.clip(room[:, None, None] - j * br, 0, br), br)
            ok = front_ok[..., None] & (jnp.arange(br)[None, None, :] < k)
            lo = 1 + d * br * br
            sl = slice(lo, lo + br * br)
            tokens = tokens.at[:, sl].set(picks.reshape(b, -1))
            parents = parents.at[:, sl].set(jnp.repeat(front, br, axis=1))
            parent_logp = jnp.repeat(logp[rows, front], br, axis=1)
            logp = logp.at[:, sl].set(parent_logp + child_logq.reshape(b, -1))
            alive = alive.at[:, sl].set(ok.reshape(b, -1))
            if key.drafter == "mtp":
                slot_hidden = slot_hidden.at[:, sl].set(jnp.repeat(h, br, axis=1))
        alive = prune(alive)
        toks_c, par_c, _ = _compact_tree(alive, tokens, parents, n)
        q_c, _ = _compact(alive, qlogits, n, 0.0)
        return toks_c, par_c, q_c

    def step(
        tflat,
        dflat,
        buf,
        table,
        handles,
        pages,
        lengths,
        root,
        tokens,
        parents,
        hidden,
        scratch,
        seeds,
        temp,
        top_k,
        top_p,
        forced=None,
    ):
        tstate = tflat.state()  # the runners' serving.runner.FlatState
        dstate = None if dflat is None else dflat.state()
        keys = row_keys(seeds)
        history = None
        if key.drafter == "ngram" and tree is not None:  # hidden: the rows' tokens
            history = hidden
            make = ngram_budget_tree if isinstance(tree, BudgetTree) else ngram_tree
            tokens, parents = make(history, lengths, root, tree, key.ngram_max)
            draft_logits = None
        elif isinstance(tree, BudgetTree):
            tokens, parents, draft_logits = draft_budget(
                tstate, dstate, buf, table, handles, pages, lengths, root, hidden, temp, keys
            )
        elif tree is not None:
            tokens, parents, draft_logits = draft_tree(
                tstate, dstate, buf, table, handles, pages, lengths, root, hidden, temp, keys
            )
        else:
            draft_logits = None
        tm = nnx.merge(key.target, tstate)
        cache = target_cache(buf, table, handles, pages, lengths, defer=True)
        sink = snapshot_sink(cache, scratch, key.snapshot)
        logits, tstate_tree, hid, *written = steps.verify_tree(
            tm, tokens, parents, cache, return_hidden=True, snapshot=key.snapshot,
            snapshot_sink=sink,
        )  # fmt: skip
        cache = written[0] if written else cache
        logits = logits.astype(jnp.float32)
        cache, (logits, hid) = cache.write_tree_state(tstate_tree, scratch).flush(logits, hid)
        path, path_len, nxt = accept(
            tokens,
            parents,
            logits,
            draft_logits,
            depth=key.depth,
            width=key.width,
            temperature=temp,
            top_k=top_k,
            top_p=top_p,
            keys=keys,
            sampling=key.sampling,
            forced=forced,
        )
        # commit from the scratch units, as the two-program path does
        cache = target_cache(cache.buffer, table, handles, pages, lengths, defer=True)
        tree_state = cache.read_tree_state(scratch, path, path_len, qk_l2norm=True)
        cache = steps.commit(cache, tree_state, path, path_len, impl=key.commit_impl).flush()
        buf = cache.buffer
        if key.drafter == "draft_model":
            dm = nnx.merge(key.draft, dstate)
            rows = jnp.arange(tokens.shape[0])[:, None]
            chunk = jnp.where(path >= 0, tokens[rows, jnp.maximum(path, 0)], 0)
            _, dcache = steps.prefill(
                dm, chunk, draft_cache(buf, table, handles, pages, lengths), path_len
            )
            buf = dcache.buffer
        out = emitted(tokens, path, path_len, nxt)
        if history is not None:
            return out, path_len, append_history(history, lengths, out, path_len), buf
        last = jnp.take_along_axis(path, (path_len - 1)[:, None], axis=1)[:, 0]
        hidden_next = hid[jnp.arange(hid.shape[0]), last]
        return out, path_len, hidden_next, buf

    def packed_step(tflat, dflat, buf, table, ints, floats, hidden):
        """``step`` on the packed inputs of :func:`pack_inputs` (the last ``table_rows`` rows
        of ``ints``: handle-table changes, applied to ``table`` first); returns ``(int32 [B,
        depth + 2]`` (the emitted tokens, then their count), ``hidden [B, H]`` (the MTP
        drafter's; the n-gram drafter's rows' tokens, the emitted ones appended; else None),
        the arena, the table)."""
        ints, table = split_table_delta(table, ints, key.table_rows)
        n, s = key.nodes, key.nodes if key.snapshot else 1
        widths = [1, None, 1, 1, n, n, s, 3, 1] + ([n] if key.forced else [])
        fixed = sum(w for w in widths if w is not None)
        widths[1] = ints.shape[1] - fixed  # the page table's width
        cols = np.cumsum(widths)[:-1]
        handles, pages, lengths, root, tokens, parents, scratch, seeds, top_k, *forced = jnp.split(
            ints, cols, axis=1
        )
        seeds = jax.lax.bitcast_convert_type(seeds, jnp.uint32)
        out, path_len, hidden_next, buf = step(
            tflat, dflat, buf, table, handles[:, 0], pages, lengths[:, 0], root[:, 0],
            tokens, parents, hidden, scratch if key.snapshot else scratch[:, 0], seeds,
            floats[:, 0], top_k[:, 0], floats[:, 1], forced[0] if forced else None,
        )  # fmt: skip
        packed = jnp.concatenate([out, path_len[:, None]], axis=1).astype(jnp.int32)
        keep = key.drafter == "mtp" or (key.drafter == "ngram" and tree is not None)
        return packed, hidden_next if keep else None, buf, table

    def tree_tokens(args):  # the packed integer inputs are positional argument 4
        return (args[4].shape[0] - key.table_rows) * key.nodes

    return launch.ByTokens(
        packed_step, key.graph_tokens, 4, count=tree_tokens, donate_argnums=(2, 3)
    )


@functools.cache
def _chained_program(key: ProgramKey):
    """The step of :func:`_program` fed by the step before it on the device: ``(tflat, dflat,
    buf, table, ints, floats, hidden, prev)`` with ``prev`` the previous step's packed output
    (emitted tokens, then their count) and ``ints`` its packed integer inputs. Each live row's
    root becomes its last emitted token, its length and its random stream's position advance
    by its count; returns the step's outputs and the advanced ``ints`` (for the next one)."""
    inner = _program(key)
    n, s = key.nodes, key.nodes if key.snapshot else 1

    def chained(tflat, dflat, buf, table, ints, floats, hidden, prev):
        b = prev.shape[0]
        mp = ints.shape[1] - (1 + 1 + 1 + n + n + s + 3 + 1)  # page-table width
        count = prev[:, -1]
        last = jnp.take_along_axis(prev[:, :-1], jnp.maximum(count - 1, 0)[:, None], axis=1)
        live = ints[:b, 0] >= 0
        step = jnp.where(live, count, 0)
        rows = ints[:b]
        rows = rows.at[:, 1 + mp].add(step)  # lengths
        # roots: a row fed no tokens (count 0: async scheduling's new rows) keeps its own
        rows = rows.at[:, 2 + mp].set(jnp.where(live & (count > 0), last[:, 0], rows[:, 2 + mp]))
        rows = rows.at[:, 3 + mp + 2 * n + s + 2].add(step)  # seeds' position
        ints = jnp.concatenate([rows, ints[b:]], axis=0)
        packed, hidden_next, buf, table = inner.fn(tflat, dflat, buf, table, ints, floats, hidden)
        return packed, hidden_next, buf, table, ints

    def tree_tokens(args):
        return (args[4].shape[0] - key.table_rows) * key.nodes

    return launch.ByTokens(chained, key.graph_tokens, 4, count=tree_tokens, donate_argnums=(2, 3))


@jax.jit
def _gather_rows(prev, src):
    """``prev``'s rows by ``src`` (``-1``: a zero row, i.e. no tokens emitted)."""
    return jnp.where((src >= 0)[:, None], prev[jnp.maximum(src, 0)], 0)


@jax.jit
def _feed_rows(prev, src, host):
    """Row ``i``: ``prev[src[i]]`` where ``src[i] >= 0``, else ``host[i]``."""
    ok = (src >= 0).reshape((-1,) + (1,) * (host.ndim - 1))
    return jnp.where(ok, prev[jnp.maximum(src, 0)], host).astype(host.dtype)


def pack_inputs(
    handles, pages, lengths, root, tokens, parents, scratch, seeds, temp, top_k, top_p, forced=None
):
    """A step's per-row inputs as two host arrays, so a step moves two small buffers to the
    device instead of eleven (each argument of a jitted call is a host-to-device copy of its
    own): ``int32 [B, 1 + MP + 1 + 1 + N + N + S + 3 + 1]`` (handles, page table, lengths, roots,
    tree tokens and parents, scratch handles (``S`` = N per-node snapshots, else 1), seeds
    (uint32 bits), top-k; then the forced targets ``[B, N]`` when given) and ``float32 [B, 2]``
    (temperature, top-p)."""
    b = np.shape(root)[0]
    seed_bits = np.asarray(seeds, np.uint32).reshape(b, -1).view(np.int32)
    extra = () if forced is None else (forced,)
    ints = pack_columns(
        b, handles, pages, lengths, root, tokens, parents, scratch, seed_bits, top_k, *extra
    )
    return ints, pack_columns(b, temp, top_p, dtype=np.float32)


class DeviceSpeculator:
    """One jitted program per speculative step (module docstring) over the target's
    :class:`serving.runner.ArenaRunner` (and the draft model's arena runner, or the target's
    MTP head, or n-gram lookups, static and budget trees alike, on the device)."""

    def __init__(self, runner, spec, *, drafter: str, draft_runner=None):
        if spec.tree is not None:
            tree = StaticTree(tuple(spec.tree))
        else:
            tree = BudgetTree(spec.budget, spec.depth, spec.branch)
        self.runner = runner
        self.draft_runner = draft_runner
        self.drafter = drafter
        self.key = ProgramKey(
            target=runner.graphdef,
            target_spec=runner.spec,
            target_kernels=runner.kernel_choice,
            commit_impl=runner.commit_impl,
            drafter=drafter,
            draft=draft_runner.graphdef if draft_runner is not None else None,
            draft_spec=draft_runner.spec if draft_runner is not None else None,
            draft_kernels=draft_runner.kernel_choice if draft_runner is not None else None,
            tree=tree,
            width=max(spec.tree) if spec.tree is not None else spec.branch,
            depth=spec.max_depth,
            snapshot=spec.verify == "snapshot",
            sampling=True,
            nodes=spec.num_nodes,
            table_rows=TABLE_DELTA_ROWS,
            make_target_cache=runner.make_cache,
            make_draft_cache=draft_runner.make_cache if draft_runner is not None else ArenaCache,
            graph_tokens=runner.graph_tokens,
            ngram_max=spec.ngram_max if drafter == "ngram" else 0,
        )
        self._dstate = None if draft_runner is None else draft_runner._state
        # the program variants, looked up once (hashing the key each step costs milliseconds)
        self._programs = {
            s: _program(dataclasses.replace(self.key, sampling=s)) for s in (False, True)
        }
        self._chained = {  # steps fed by the step before on the device (ahead)
            s: _chained_program(dataclasses.replace(self.key, sampling=s)) for s in (False, True)
        }
        self._host_key = self.key  # the programs of trees the host sends (tokens, parents)
        if self.history:  # another host drafter may stand in for the n-gram one
            self._host_key = dataclasses.replace(self.key, tree=None, ngram_max=0)
        self._host_programs = {
            (s, f): _program(dataclasses.replace(self._host_key, sampling=s, forced=f))
            for s in (False, True)
            for f in (False, True)
        }
        self.num_nodes = spec.num_nodes
        self.calls = 0

    def compiled(self) -> int:
        n = sum(
            make(dataclasses.replace(self.key, sampling=s))._cache_size()
            for s in (False, True)
            for make in (_program, _chained_program)
        )
        extra = self._host_programs.items()
        if self._host_key is self.key:
            extra = [(sf, f) for sf, f in extra if sf[1]]  # the forced ones only
        n += sum(f._cache_size() for _, f in extra)
        return n

    @property
    def chains(self) -> bool:
        """Whether steps can follow each other on the device (:meth:`ahead`): the drafter
        drafts on the device (every drafter's trees do)."""
        return self.key.tree is not None

    @property
    def history(self) -> bool:
        """Whether a step takes the rows' tokens (``hidden``: ``int32 [B, L]``, each row's
        tokens, its root at its length): the n-gram drafter's trees, drafted on the device
        (:func:`ngram_tree`, :func:`ngram_budget_tree`)."""
        return self.drafter == "ngram" and self.key.tree is not None

    def __call__(
        self,
        handles,
        pages,
        lengths,
        root,
        scratch,
        seeds,
        temp,
        top_k,
        top_p,
        *,
        hidden=None,
        tokens=None,
        parents=None,
        forced=None,
    ):
        """One step: returns host arrays ``(emitted int32 [B, depth + 1], counts int32 [B],
        hidden [B, H]`` (the MTP drafter's next hidden states; None for the others)), fetched
        from the device in one transfer (the arena updated in place). The inputs go to the
        device packed in two arrays (:func:`pack_inputs`); ``hidden``: the MTP drafter's
        hidden states, or for the n-gram drafter (:attr:`history`) the rows' tokens ``int32
        [B, L]``; ``tokens`` and ``parents``: the host's trees (a host drafter in the n-gram
        one's place); ``forced int32 [B, N]``: with the host's trees, the target's stand-in choices
        (:func:`accept`; a benchmark's replayed continuations)."""
        out, counts, hid = self.ahead(
            handles, pages, lengths, root, scratch, seeds, temp, top_k, top_p,
            steps=1, hidden=hidden, tokens=tokens, parents=parents, forced=forced,
        )  # fmt: skip
        return out[0], counts[0], hid

    def _inputs(
        self, handles, pages, lengths, root, scratch, seeds, temp, top_k, top_p, tokens, parents,
        forced,
    ):  # fmt: skip
        """A step's inputs packed (:func:`pack_inputs`; ``tokens``, ``parents`` None: trees
        drafted on the device), the handle table's pending changes carried in them: ``(ints,
        floats, table, sampling)``."""
        if tokens is None:
            tokens = parents = np.zeros((root.shape[0], self.num_nodes), np.int32)
        ints, floats = pack_inputs(
            handles, pages, lengths, root, tokens, parents, scratch, seeds, temp, top_k, top_p,
            forced,
        )  # fmt: skip
        table, delta = self.runner.table_delta(TABLE_DELTA_ROWS)
        return with_table_delta(ints, delta), floats, table, bool(np.any(temp > 0))

    def dispatch(
        self,
        handles,
        pages,
        lengths,
        root,
        scratch,
        seeds,
        temp,
        top_k,
        top_p,
        *,
        hidden=None,
        prev=None,
        prev_hidden=None,
        src=None,
    ):
        """One step dispatched and not fetched (async scheduling): returns the device values
        ``(packed int32 [B, depth + 2]`` (emitted tokens, then their count), ``hidden)`` (the
        MTP drafter's next hidden states, the n-gram drafter's rows' tokens with the emitted
        ones appended, else None). ``prev``, ``prev_hidden``: a step still in flight, ``src
        int32 [B]``: each row's row in it (``-1``: none): such a row's root, length and
        random-stream position advance by its emitted tokens there and its ``hidden`` row is
        that step's, on the device (:func:`_chained_program`); the other rows take the host's
        inputs as given."""
        if not self.chains:
            raise ValueError(f"dispatch needs trees drafted on the device, got {self.drafter!r}")
        r = self.runner
        if self.drafter != "mtp" and not self.history:
            hidden = prev_hidden = None
        self.calls += 1
        ints, floats, table, sampling = self._inputs(
            handles, pages, lengths, root, scratch, seeds, temp, top_k, top_p, None, None, None
        )
        fed = prev is not None and src is not None and bool((src >= 0).any())
        if not fed:
            packed, hidden, r._buf, table = self._programs[sampling](
                r._state, self._dstate, r._buf, table, ints, floats, hidden
            )
        else:
            prev = _gather_rows(prev, src)
            if hidden is not None and prev_hidden is not None:
                hidden = _feed_rows(prev_hidden, src, hidden)
            packed, hidden, r._buf, table, _ = self._chained[sampling](
                r._state, self._dstate, r._buf, table, ints, floats, hidden, prev
            )
        r.adopt_table(table)
        return packed, hidden

    def ahead(
        self,
        handles,
        pages,
        lengths,
        root,
        scratch,
        seeds,
        temp,
        top_k,
        top_p,
        *,
        steps,
        hidden=None,
        tokens=None,
        parents=None,
        forced=None,
    ):
        """``steps`` speculative steps dispatched back to back, each fed the previous one's
        emitted tokens, lengths and (MTP) hidden states or (n-gram) tokens on the device
        (:func:`_chained_program`), so the host's work for a step overlaps the device's for
        the one before; one fetch at the end. The rows' pages must hold ``steps * (depth +
        1)`` more tokens. Returns host arrays ``(emitted int32 [steps, B, depth + 1], counts
        int32 [steps, B], hidden [B, H]`` after the last step (MTP; else None)). A row's
        outputs after its request stops are computed and not used."""
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        host_trees = tokens is not None
        if steps > 1 and (host_trees or not self.chains):
            raise ValueError(f"steps ahead need trees drafted on the device, got {self.drafter!r}")
        if forced is not None and (not host_trees or np.shape(forced) != np.shape(tokens)):
            raise ValueError(
                f"forced: one target choice per node of the host's trees "
                f"{np.shape(tokens) if host_trees else 'none given'}, got {np.shape(forced)}"
            )
        r = self.runner
        if self.drafter != "mtp" and not (self.history and not host_trees):
            hidden = None  # only the MTP drafter reads it (None: nothing moves to the device)
        self.calls += steps
        # the table's changes ride in ``ints``; later chained steps re-apply them (same rows)
        ints, floats, table, sampling = self._inputs(
            handles, pages, lengths, root, scratch, seeds, temp, top_k, top_p, tokens, parents,
            forced,
        )  # fmt: skip
        first, chained = self._programs[sampling], self._chained[sampling]
        if host_trees:
            first = self._host_programs[sampling, forced is not None]
        packed, hidden, r._buf, table = first(
            r._state, self._dstate, r._buf, table, ints, floats, hidden
        )
        outs = [packed]
        for _ in range(steps - 1):
            packed, hidden, r._buf, table, ints = chained(
                r._state, self._dstate, r._buf, table, ints, floats, hidden, packed
            )
            outs.append(packed)
        r.adopt_table(table)
        if self.history or host_trees:
            hidden = None  # the rows' tokens: the host has them
        outs, hidden = jax.device_get((outs, hidden))
        outs = np.stack(outs)
        return outs[:, :, :-1], outs[:, :, -1], hidden
