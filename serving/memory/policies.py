"""Placement policies: which pools exist, which segments each may use, how a pool grows.

All four run on the same manager code path (same arena, same handles, same copies); they
differ only in the decisions below. A policy never mutates state: :meth:`Policy.plan` reads the
segment map (segments.py) and returns the segments a pool should take (unowned ones, or ones
another pool must give up after its live units are moved out), or ``None`` when no such set
exists. The allocator (allocator.py) checks nothing else and executes the plan, so a ``None``
plan is what makes a failed allocation change nothing.

- ``avmp``: one segment space shared by the KV, state and stash pools (and a snapshot pool
  when a draft model's fields make state slots bigger than snapshot units). A pool takes unowned
  segments first, then wholly free segments of other pools (those of the pool with the most
  free segments first: no data moves), then compacts: among the segments other pools can give
  up (each keeps room for its live units), it takes the set that costs least to empty, one
  copy kernel per victim pool (``Policy.launch_bytes``) plus the bytes of the live units it
  moves.
- ``static_dual(ratio)``: SGLang-style split. ``ratio`` is ``mamba_full_memory_ratio``
  (state-side bytes / KV-side bytes); the KV side never lends to the state side or back.
  The state and stash pools share the state side as in AVMP.
- ``multi_ended``: SGLang's unified allocator. KV segments form a prefix of the arena, state and
  stash segments a suffix; a pool grows at its end of the gap and, when the gap is empty,
  the other side compacts away from the boundary (only boundary segments can change hands).
- ``unified_padded``: vLLM-style. One pool whose unit is a KV page enlarged (``page_size``
  multiplied) until one page holds a state slot and a stash; states and stashes are padded to
  it (``stats()["padding_bytes"]``). vLLM equalises pages per layer group instead of per model;
  with Qwen3.5's 3:1 layer mix that page is 3x smaller than ours, a state then spans 3 pages.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from typing import TYPE_CHECKING, Any

from serving.memory.layout import KINDS, POOL_OF_KIND, WORD_BYTES, HybridLayout

if TYPE_CHECKING:
    from serving.memory.pools import Pool
    from serving.memory.segments import SegmentMap


def _most_empty_first(q: Pool) -> tuple[int, int]:
    return -len(q.empty), q.index


class Policy:
    """Base policy: the AVMP decisions; subclasses override what differs."""

    name = "avmp"

    def __init__(self, **kwargs: Any):
        if kwargs:
            raise ValueError(f"policy {self.name!r} takes no arguments, got {sorted(kwargs)}")

    def effective_layout(self, layout: HybridLayout) -> HybridLayout:
        return layout

    def pool_of_kind(self, layout: HybridLayout) -> dict[str, str]:
        """Pool name of each kind: :data:`POOL_OF_KIND`, except that a ``snapshot`` unit
        smaller than a state slot (a draft model's fields live in state slots only) gets its
        own ``snapshot`` pool rather than a state slot's room."""
        out = dict(POOL_OF_KIND)
        if layout.unit_words("snapshot") != layout.unit_words("state"):
            out["snapshot"] = "snapshot"
        return out

    def pool_groups(self, pool_names: list[str], num_segments: int) -> tuple[list[int], list[int]]:
        """(group of each pool, group of each segment): a pool only ever owns its group."""
        return [0] * len(pool_names), [0] * num_segments

    # A copy kernel's launch costs about as much as copying this many bytes (5 us at ~4 TB/s,
    # read + write): the exchange rate between "compact one more pool" and "move more bytes".
    launch_bytes = 10 << 20

    def plan(self, segmap: SegmentMap, pool: Pool, need: int) -> list[int] | None:
        """``need`` segments for ``pool`` to take, in the order it fills them, or ``None``."""
        unowned = segmap.unowned[pool.group]
        if len(unowned) >= need:
            return unowned[:need]
        group = pool.group
        others = [q for q in segmap.pools if q is not pool and q.group == group]
        chosen = list(unowned)
        empties = len(chosen)
        for q in others:
            empties += len(q.empty)
        if empties >= need:
            # Wholly free segments move no data; take them from the pool with the most first
            # (the one least likely to need a segment back soon), lowest segments first.
            # (``others`` is in index order: the usual two need no sort.)
            if len(others) == 2:
                a, b = others
                order = (b, a) if len(b.empty) > len(a.empty) else others
            else:
                order = sorted(others, key=_most_empty_first)
            for q in order:
                k = need - len(chosen)
                if k == 1:
                    if q.empty:
                        chosen.append(min(q.empty))
                        return chosen
                    continue
                chosen += sorted(q.empty)[:k]
                if len(chosen) == need:
                    return chosen
        # Fail fast: every other pool can give up all but the segments its live units need.
        if len(unowned) + sum(len(q.owned) - q.min_segments() for q in others) < need:
            return None
        for q in sorted(others, key=_most_empty_first):
            chosen += sorted(q.empty)  # all of them: they do not cover the need
        compacted = self._cheapest_compaction(segmap, others, need - len(chosen))
        return None if compacted is None else chosen + compacted

    def _cheapest_compaction(
        self, segmap: SegmentMap, others: list[Pool], count: int
    ) -> list[int] | None:
        """``count`` busy segments of ``others`` whose evacuation costs least, or ``None``.

        Pool ``q`` can give up at most ``owned - empty - min_segments`` busy segments (its
        free segments are already taken), cheapest = fewest live units first. Cost of a choice:
        the bytes of the units it moves plus ``launch_bytes`` per pool it touches (each victim
        pool is one copy kernel). Every subset of victim pools is tried (there are at most three
        other pools), so the choice is the cheapest, and deterministic (ties: fewer pools, then
        lower pool index, then higher segment: the low segments stay packed)."""
        live = segmap.seg_live
        cands = []
        for q in others:
            extra = len(q.owned) - q.min_segments() - len(q.empty)
            if extra <= 0:
                continue
            busy = heapq.nsmallest(
                min(extra, count),
                (s for s in q.owned if s not in q.empty),
                key=lambda s: (live[s], -s),
            )
            unit_bytes = q.unit_words * WORD_BYTES
            cands.append([(live[s] * unit_bytes, q.index, -s, s) for s in busy])
        best = None
        for r in range(1, len(cands) + 1):
            for subset in itertools.combinations(cands, r):
                merged = sorted(itertools.chain.from_iterable(subset))[:count]
                if len(merged) < count:
                    continue
                pools_used = len({c[1] for c in merged})
                key = (sum(c[0] for c in merged) + self.launch_bytes * pools_used, pools_used)
                if best is None or key < best[0]:
                    best = (key, [c[3] for c in merged])
        return None if best is None else best[1]


class StaticDual(Policy):
    """Fixed KV / state split; ``ratio`` = state-side bytes / KV-side bytes (SGLang's
    ``mamba_full_memory_ratio``, whose default is 0.9)."""

    name = "static_dual"

    def __init__(self, ratio: float = 0.9):
        if not ratio > 0:
            raise ValueError(f"static_dual ratio must be > 0, got {ratio!r}")
        self.ratio = float(ratio)

    def pool_groups(self, pool_names: list[str], num_segments: int) -> tuple[list[int], list[int]]:
        if num_segments < 2:
            raise ValueError(f"static_dual needs >= 2 segments, the budget gives {num_segments}")
        n_state = round(num_segments * self.ratio / (1 + self.ratio))
        n_state = min(max(n_state, 1), num_segments - 1)
        n_kv = num_segments - n_state
        return ([0 if n == "kv" else 1 for n in pool_names], [0] * n_kv + [1] * n_state)


class MultiEnded(Policy):
    """KV grows up from segment 0, state and stash grow down from the last segment."""

    name = "multi_ended"

    def plan(self, segmap: SegmentMap, pool: Pool, need: int) -> list[int] | None:
        owner = segmap.seg_owner
        if pool.name == "kv":
            # Everything above the KV prefix, lowest first: the gap, then the state side.
            order = (s for s in range(segmap.num_segments) if owner[s] != pool.index)
        else:
            siblings = [q for q in segmap.pools if q.name != "kv" and q is not pool]
            empties = sorted(s for q in siblings for s in q.empty)
            high = {q.index for q in segmap.pools if q.name != "kv"}
            below = (s for s in range(segmap.num_segments - 1, -1, -1) if owner[s] not in high)
            order = iter(empties + list(below))
        chosen = []
        for s in order:
            if len(chosen) == need:
                break
            chosen.append(s)
        if len(chosen) < need:
            return None
        # Only boundary segments can move, so check that each victim can absorb its units.
        for q in segmap.pools:
            mine = [s for s in chosen if owner[s] == q.index and q is not pool]
            if not mine:
                continue
            live = sum(segmap.seg_live[s] for s in mine)
            free_inside = sum(q.units_per_segment - segmap.seg_live[s] for s in mine)
            if q.free_units - free_inside < live:
                return None
        return chosen


class UnifiedPadded(Policy):
    """One pool of enlarged KV pages; every state and stash is padded to one page."""

    name = "unified_padded"

    def effective_layout(self, layout: HybridLayout) -> HybridLayout:
        biggest = max(layout.state_slot_bytes, layout.stash_bytes)
        mult = -(-biggest // layout.kv_page_bytes)
        return dataclasses.replace(layout, page_size=layout.page_size * mult)

    def pool_of_kind(self, layout: HybridLayout) -> dict[str, str]:
        return dict.fromkeys(KINDS, "unified")


POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (Policy, StaticDual, MultiEnded, UnifiedPadded)
}


def make_policy(name: str, **kwargs: Any) -> Policy:
    """The policy called ``name`` (one of :data:`POLICIES`) with its arguments."""
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {name!r}")
    try:
        return POLICIES[name](**kwargs)
    except TypeError as e:
        raise ValueError(f"bad arguments for policy {name!r}: {e}") from None
