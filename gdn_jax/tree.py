"""Host-side draft trees: validation, depth, ancestor masks, padding, tries of token paths.

Nodes ``0..N-1`` are in topological order: ``parents[n] < n``; ``-1`` hangs a node off the
committed state; ``-2`` marks a padding node (no parent, parent of nobody, output ignored).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

ROOT = -1
PAD = -2


def validate_parents(parents: np.ndarray, arg: str = "parents") -> None:
    """Raises ``ValueError`` naming ``arg`` unless every row of ``parents`` is a valid tree."""
    p = np.asarray(parents)
    if p.ndim not in (1, 2):
        raise ValueError(f"{arg}: expected shape [N] or [B, N], got {p.shape}")
    if not np.issubdtype(p.dtype, np.integer):
        raise ValueError(f"{arg}: must be integer, got dtype {p.dtype}")
    rows = p.reshape(-1, p.shape[-1])
    n = rows.shape[1]
    idx = np.arange(n)
    for r, row in enumerate(rows):
        where = f"{arg}[{r}]" if p.ndim == 2 else arg
        bad = np.nonzero(row < PAD)[0]
        if bad.size:
            i = bad[0]
            raise ValueError(
                f"{where}[{i}] = {row[i]} is out of range (allowed: -2, -1, 0..{i - 1})"
            )
        bad = np.nonzero(row >= idx)[0]
        if bad.size:
            i = bad[0]
            rule = (
                "is out of range" if row[i] >= n else "must be < its own index (topological order)"
            )
            raise ValueError(f"{where}[{i}] = {row[i]} {rule}")
        kids = row[row >= 0]
        pad_parent = kids[row[kids] == PAD] if kids.size else kids
        if pad_parent.size:
            i = int(np.nonzero(row == pad_parent[0])[0][0])
            raise ValueError(f"{where}[{i}] = {pad_parent[0]} is a padding node (-2), not a parent")


def validate_path(parents: np.ndarray, path: np.ndarray, path_len: np.ndarray) -> None:
    """Raises ``ValueError`` unless ``path[b, :path_len[b]]`` is a root-to-node chain of tree b."""
    p = np.atleast_2d(np.asarray(parents))
    path = np.asarray(path)
    path_len = np.asarray(path_len)
    b, n = p.shape
    d = path.shape[1]
    if (path_len < 0).any() or (path_len > d).any():
        raise ValueError(f"path_len: every entry must be in [0, {d}], got {path_len.tolist()}")
    for r in range(b):
        prev = ROOT
        for j in range(int(path_len[r])):
            node = int(path[r, j])
            if not 0 <= node < n:
                raise ValueError(f"path[{r}, {j}] = {node} is not a node id in [0, {n})")
            if p[r, node] != prev:
                want = "a root (parent -1)" if prev == ROOT else f"a child of node {prev}"
                raise ValueError(
                    f"path[{r}]: is not a chain of the tree: node {node} at step {j} is not "
                    f"{want} (its parent is {p[r, node]})"
                )
            prev = node


def depths(parents: np.ndarray) -> np.ndarray:
    """Number of strict ancestors of each node (``-1`` for padding nodes)."""
    p = np.asarray(parents)
    d = np.zeros(p.shape, np.int32)
    for n in range(p.shape[-1]):
        par = p[..., n]
        d[..., n] = np.where(
            par >= 0, np.take_along_axis(d, np.maximum(par, 0)[..., None], -1)[..., 0] + 1, 0
        )
        d[..., n] = np.where(par == PAD, -1, d[..., n])
    return d


@dataclasses.dataclass(frozen=True, eq=False)
class DraftTree:
    """A validated draft tree (and optionally its tokens), built on the host.

    ``parents`` is int32 ``[N]``; ``tokens`` int32 ``[N]`` or ``None`` (``-1`` on padding).
    """

    parents: np.ndarray
    tokens: np.ndarray | None = None

    def __post_init__(self):
        p = np.asarray(self.parents)
        if p.ndim != 1:
            raise ValueError(f"parents: expected a 1-D list of parent ids, got shape {p.shape}")
        if p.size == 0:
            raise ValueError("parents: a draft tree needs at least one node")
        validate_parents(p)
        object.__setattr__(self, "parents", p.astype(np.int32))
        if self.tokens is not None:
            t = np.asarray(self.tokens, np.int32)
            if t.shape != p.shape:
                raise ValueError(f"tokens: expected shape {p.shape} like parents, got {t.shape}")
            object.__setattr__(self, "tokens", t)

    @classmethod
    def from_parents(cls, parents: Sequence[int], tokens: Sequence[int] | None = None) -> DraftTree:
        """A tree from its parent list (``-1`` root children, ``-2`` padding)."""
        return cls(np.asarray(list(parents)), tokens)

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]]) -> DraftTree:
        """The trie of candidate continuations: one node per distinct token prefix.

        Nodes are numbered breadth-first (by depth, then first appearance), a topological order.
        """
        if not paths or any(len(p) == 0 for p in paths):
            raise ValueError("paths: expected a non-empty list of non-empty token sequences")
        ids: dict[tuple[int, ...], int] = {}
        parents: list[int] = []
        tokens: list[int] = []
        for depth in range(max(len(p) for p in paths)):
            for path in paths:
                if depth >= len(path):
                    continue
                prefix = tuple(int(t) for t in path[: depth + 1])
                if prefix not in ids:
                    ids[prefix] = len(parents)
                    parents.append(ids[prefix[:-1]] if depth else ROOT)
                    tokens.append(prefix[-1])
        return cls(np.asarray(parents, np.int64), np.asarray(tokens, np.int64))

    @property
    def num_nodes(self) -> int:
        """``N``, padding included."""
        return int(self.parents.shape[0])

    @property
    def num_real(self) -> int:
        return int((self.parents != PAD).sum())

    @property
    def depth(self) -> np.ndarray:
        """int32 ``[N]``: strict ancestors per node (root children 0, padding -1)."""
        return depths(self.parents)

    def ancestor_mask(self, inclusive: bool = True) -> np.ndarray:
        """bool ``[N, N]``: ``[n, i]`` is set when ``i`` is on ``path(n)`` (or ``anc(n)``)."""
        n = self.num_nodes
        m = np.zeros((n, n), bool)
        for i, par in enumerate(self.parents):
            if par >= 0:
                m[i] = m[par]
                m[i, par] = True
        return m | np.eye(n, dtype=bool) if inclusive else m

    def bitmask(self) -> np.ndarray:
        """int64 ``[N]``: bit ``i`` of entry ``n`` set when ``i`` is on ``path(n)``; ``N <= 64``."""
        if self.num_nodes > 64:
            raise ValueError(f"bitmask: needs N <= 64 nodes, tree has {self.num_nodes}")
        bits = np.zeros(self.num_nodes, np.uint64)
        for i, par in enumerate(self.parents):
            bits[i] = (bits[par] if par >= 0 else np.uint64(0)) | (np.uint64(1) << np.uint64(i))
        return bits.view(np.int64)

    def path(self, node: int) -> list[int]:
        """Node ids from the root to ``node`` inclusive."""
        if not 0 <= node < self.num_nodes or self.parents[node] == PAD:
            raise ValueError(f"node: {node} is not a real node of this {self.num_nodes}-node tree")
        out = []
        while node >= 0:
            out.append(int(node))
            node = int(self.parents[node])
        return out[::-1]

    def path_array(self, node: int, max_depth: int) -> tuple[np.ndarray, int]:
        """``(path int32 [max_depth] padded with -1, path_len)`` for ``tree_commit``."""
        p = self.path(node)
        if len(p) > max_depth:
            raise ValueError(f"max_depth: path to node {node} has {len(p)} nodes > {max_depth}")
        out = np.full(max_depth, -1, np.int32)
        out[: len(p)] = p
        return out, len(p)

    def children(self, node: int) -> list[int]:
        """Direct children of ``node`` (``-1`` for the root children)."""
        return [int(i) for i in np.nonzero(self.parents == node)[0]]

    def leaves(self) -> list[int]:
        real = self.parents != PAD
        has_child = np.zeros(self.num_nodes, bool)
        has_child[self.parents[self.parents >= 0]] = True
        return [int(i) for i in np.nonzero(real & ~has_child)[0]]

    def pad(self, n: int) -> DraftTree:
        """The same tree with ``-2`` padding nodes appended up to ``n`` nodes."""
        if n < self.num_nodes:
            raise ValueError(f"n: cannot pad a {self.num_nodes}-node tree to {n} nodes")
        extra = n - self.num_nodes
        parents = np.concatenate([self.parents, np.full(extra, PAD, np.int32)])
        tokens = None
        if self.tokens is not None:
            tokens = np.concatenate([self.tokens, np.full(extra, -1, np.int32)])
        return DraftTree(parents, tokens)

    def __len__(self) -> int:
        return self.num_nodes

    def __repr__(self) -> str:
        return f"DraftTree(parents={self.parents.tolist()}, tokens={None if self.tokens is None else self.tokens.tolist()})"
