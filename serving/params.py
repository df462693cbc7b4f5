"""User-facing options: how to sample (:class:`SamplingParams`) and how to speculate
(:class:`SpecConfig`). Both validate on construction and name the bad argument."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

METHODS = ("ngram", "draft_model", "mtp")
VERIFIERS = ("wy", "snapshot")
# Most nodes of one draft tree (root included). Verify builds [N, N] matrices per head and the
# scratch holds N nodes per request, so the bound keeps a typo from asking for gigabytes.
MAX_NODES = 1024


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0`` is greedy; otherwise softmax(logits / temperature) restricted to the
    ``top_k`` most likely tokens (0: all) and the smallest set of mass ``>= top_p``. Random draws
    are keyed by ``(seed, request index, output position)``, so a request's tokens do not depend
    on batching or preemption. Generation stops after ``max_tokens`` tokens, at a token of
    ``stop_token_ids`` (kept in the output) or when the text contains a string of ``stop``
    (the text is cut before it; needs the model's tokenizer)."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {self.max_tokens!r}")
        if not _is_real(self.temperature):
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p):
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")
        if not _is_int(self.seed):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        ids = self.stop_token_ids
        if isinstance(ids, int | str) or not all(_is_int(t) and t >= 0 for t in ids):
            raise ValueError(f"stop_token_ids must be a sequence of ints >= 0, got {ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(
                f"stop must be a string or a sequence of non-empty strings, got {stop!r}"
            )
        object.__setattr__(self, "stop", tuple(stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding.

    Args:
      method: the drafter: ``"ngram"`` (prompt lookup, no model), ``"draft_model"`` (a small
        model, ``draft_model`` = HF directory, config or ``HybridLM``), ``"mtp"`` (the target's
        own MTP head).
      tree: static tree as children per depth, e.g. ``(4, 2, 2)``: the root (the last sampled
        token) gets 4 children, each of them 2, each of those 2 (29 nodes); ``(1, 1, 1, 1)`` is
        a chain of 4 drafts.
      budget: instead of ``tree``, a dynamic tree of at most ``budget`` nodes: level by level,
        the ``branch`` best children of the most probable frontier nodes (by cumulative draft
        probability), down to ``depth``; greedy keeps the top ``budget`` nodes overall.
      verify: ``"wy"`` (tree WY: one solve per head, no per-node state) or ``"snapshot"`` (a
        full recurrent state per draft node, the vLLM/SGLang method).
    """

    method: str = "ngram"
    draft_model: Any = None
    tree: tuple[int, ...] | None = (4, 2, 2)
    budget: int | None = None
    verify: str = "wy"
    depth: int = 4
    branch: int = 4
    ngram_max: int = 3

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.verify not in VERIFIERS:
            raise ValueError(f"verify must be one of {VERIFIERS}, got {self.verify!r}")
        if self.method == "draft_model" and self.draft_model is None:
            raise ValueError("draft_model: method='draft_model' needs a draft model")
        if self.budget is not None:
            if not _is_int(self.budget) or not 2 <= self.budget <= MAX_NODES:
                raise ValueError(
                    f"budget must be an int in [2, {MAX_NODES}] (nodes of the tree), "
                    f"got {self.budget!r}"
                )
            object.__setattr__(self, "tree", None)
        elif self.tree is None:
            raise ValueError("tree: give a static tree like (4, 2, 2) or a budget")
        else:
            try:
                tree = tuple(self.tree)
            except TypeError:
                raise ValueError(
                    f"tree must be a tuple of positive ints, got {self.tree!r}"
                ) from None
            if not tree or any(not _is_int(b) or b < 1 for b in tree):
                raise ValueError(f"tree must be a non-empty tuple of positive ints, got {tree!r}")
            if len(tree) >= MAX_NODES:
                raise ValueError(
                    f"tree: {len(tree)} levels, more than {MAX_NODES - 1} draft levels"
                )
            object.__setattr__(self, "tree", tree)
            if self.num_nodes > MAX_NODES:
                raise ValueError(
                    f"tree: {tree} has {self.num_nodes} nodes (root included), more than "
                    f"{MAX_NODES}"
                )
        for name in ("depth", "branch", "ngram_max"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if self.depth >= MAX_NODES:
            raise ValueError(f"depth must be < {MAX_NODES}, got {self.depth!r}")

    @property
    def max_depth(self) -> int:
        """Draft tokens on the longest path below the root."""
        return len(self.tree) if self.tree is not None else self.depth

    @property
    def num_nodes(self) -> int:
        """Static node count ``N`` of every verified tree (the root included)."""
        if self.tree is None:
            return self.budget
        total, width = 1, 1
        for b in self.tree:
            width *= b
            total += width
        return total
