"""Drafters: fill a :class:`TreeBuilder` per request, level by level.

- :class:`NgramDrafter`: prompt lookup. At a node, the context is the request's tokens plus
  the drafted path; the continuations of the earlier occurrences of its last ``n`` tokens
  (``n = ngram_max .. 1``, the longest that matches) are the children, ranked by count.
- :class:`ModelDrafter`: a small :class:`HybridLM` with its own cache (its ``draft_*`` fields of
  the target's arena units, or its own pools with ``cache="pools"``) mirroring the
  target's committed tokens; each level is one ``verify_tree`` of the draft model over the
  partial tree, whose logits at the frontier nodes give their children.
- :class:`MTPDrafter`: the target's MTP head; node ``n``'s input is its parent's MTP hidden
  state (the target's last hidden state for the root) and its own token.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from serving.runner import ArenaRunner, ModelRunner, MTPRunner
from serving.spec_trees import TreeBuilder, log_share


def _softmax(x: np.ndarray, temperature: float) -> np.ndarray:
    x = np.asarray(x, np.float64) / (temperature if temperature > 0 else 1.0)
    x = x - x.max(axis=-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)


def ngram_candidates(tokens: np.ndarray, ngram_max: int) -> tuple[np.ndarray, np.ndarray] | None:
    """``(next tokens [C] ascending, their counts [C])``: the tokens that followed earlier
    occurrences of the longest suffix (up to ``ngram_max`` tokens) of ``tokens`` that occurred
    before, sparse; ``None`` if none did."""
    for n in range(min(ngram_max, len(tokens) - 1), 0, -1):
        windows = sliding_window_view(tokens[:-1], n)
        hits = np.nonzero((windows == tokens[-n:]).all(axis=1))[0]
        if hits.size:
            return np.unique(tokens[hits + n], return_counts=True)
    return None


class NgramDrafter:
    uses_model = False

    def __init__(self, ngram_max: int, vocab: int):
        self.ngram_max = ngram_max
        self.vocab = vocab

    def compiled(self) -> int:
        return 0

    def draft(self, contexts: list[np.ndarray], builders: list[TreeBuilder], **_) -> None:
        """``contexts[i]``: request ``i``'s tokens (its root last)."""
        for ctx, tb in zip(contexts, builders, strict=True):
            level = 0
            while nodes := tb.frontier(level):
                for node in nodes:
                    path = []
                    n = node
                    while n > 0:
                        path.append(tb.tokens[n])
                        n = tb.parents[n]
                    ext = np.concatenate([ctx, np.asarray(path[::-1], ctx.dtype)])
                    found = ngram_candidates(ext, self.ngram_max)
                    if found is not None:
                        nxt, counts = found
                        keep = nxt < self.vocab
                        if keep.any():
                            c, total = counts[keep], counts[keep].sum()
                            tb.propose(node, nxt[keep], c / total, log_share(c, total))
                level += 1
            tb.finish()


class ModelDrafter:
    """Drafts with a small model whose cache mirrors the target's committed tokens."""

    uses_model = True

    def __init__(self, runner: ModelRunner | ArenaRunner, num_nodes: int):
        self.runner = runner
        self.num_nodes = num_nodes

    def compiled(self) -> int:
        return self.runner.compiled()

    def draft(self, contexts, builders, *, rows, temperature: float, **_) -> None:
        """``rows``: ``(ids, page_table, lengths)`` of the batch, padded to its bucket (the
        target's handles for an arena runner, dense slot and page ids for a pools runner)."""
        slots, table, lengths = rows
        b = slots.shape[0]
        level = 0
        while True:
            fronts = [tb.frontier(level) for tb in builders]
            if not any(fronts):
                break
            tokens = np.zeros((b, self.num_nodes), np.int32)
            parents = np.full((b, self.num_nodes), -2, np.int32)
            parents[:, 0] = -1
            for i, tb in enumerate(builders):
                tokens[i], parents[i] = tb.arrays(self.num_nodes)
            logits = self.runner.tree_logits(slots, table, lengths, tokens, parents)
            logits = np.asarray(logits)
            for i, (tb, nodes) in enumerate(zip(builders, fronts, strict=True)):
                for node in nodes:
                    tb.expand(node, _softmax(logits[i, node], temperature))
            level += 1
        for tb in builders:
            tb.finish()


class MTPDrafter:
    uses_model = False

    def __init__(self, runner: MTPRunner):
        self.runner = runner

    def compiled(self) -> int:
        return self.runner.compiled()

    def draft(self, contexts, builders, *, hidden: list[np.ndarray], temperature: float, **_):
        """``hidden[i]``: the target's last hidden state of request ``i`` (before its root)."""
        for tb, h in zip(builders, hidden, strict=True):
            tb.data[0] = h
        level = 0
        while True:
            fronts = [tb.frontier(level) for tb in builders]
            items = [(i, n) for i, nodes in enumerate(fronts) for n in nodes]
            if not items:
                break
            f = 1 << (len(items) - 1).bit_length()  # bucket: a power of two
            hs = np.zeros((f, hidden[0].shape[-1]), hidden[0].dtype)
            toks = np.zeros(f, np.int32)
            for j, (i, n) in enumerate(items):
                hs[j] = builders[i].data[n]
                toks[j] = builders[i].tokens[n]
            logits, h_out = self.runner(hs, toks)
            logits, h_out = np.asarray(logits), np.asarray(h_out)
            for j, (i, n) in enumerate(items):
                tb = builders[i]
                before = len(tb)
                tb.expand(n, _softmax(logits[j], temperature))
                for c in range(before, len(tb)):
                    tb.data[c] = h_out[j]
            level += 1
        for tb in builders:
            tb.finish()
