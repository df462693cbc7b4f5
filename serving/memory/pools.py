"""Host-side bookkeeping of one pool: which segments it owns and where its free units are.

A pool holds units of one size (``unit_words``); each of its segments holds
``units_per_segment`` of them (the segment tail that no whole unit fills stays unused).
Within a pool every free unit serves every allocation, so a pool never needs compaction for
itself; compaction only moves units so that whole segments can change pool.

Fill order: oldest segment first. Every acquisition of a segment gives it a new rank (a
counter of the segment map, segments.py); a pool places new units in its lowest-ranked segment
with a free unit (ranks are unique, so there are no ties). Long-owned segments stay packed and
the ones it took last drain first, so the segments another pool may need are the emptiest ones
(cheap to compact, often wholly free). For a pool that only ever takes unowned segments in
order this is the lowest segment first.
"""

from __future__ import annotations

import heapq


class Pool:
    """Segments owned by one pool, with a lazy min-heap of the keys ``rank * S + segment`` of
    its segments that have a free unit.

    The segment map keeps ``seg_key[segment]``: the key under which the segment is validly in
    its owner's heap, or -1 (full, or not owned). A heap entry is stale when it differs from
    that (the segment changed hands, was re-ranked, or filled up); the allocation path drops
    stale entries as it meets them, one comparison each. ``empty`` (owned segments with no live
    unit) is a set: the policies ask it for its few smallest members (``heapq.nsmallest``),
    never sort it. ``seg_rank`` is the segment map's per-segment list, shared (not copied).
    """

    def __init__(
        self,
        index: int,
        name: str,
        unit_words: int,
        units_per_segment: int,
        group: int,
        seg_rank: list[int],
    ):
        self.index = index
        self.name = name
        self.unit_words = unit_words
        self.units_per_segment = units_per_segment
        self.group = group
        self.owned: set[int] = set()
        self.empty: set[int] = set()  # owned segments with no live unit
        self.live = 0
        self.free_units = 0
        self.heap: list[int] = []
        self._rank = seg_rank
        self._nseg = len(seg_rank)

    def copy(self, seg_rank: list[int]) -> Pool:
        """An independent copy of this pool that reads ranks from ``seg_rank``."""
        new = object.__new__(Pool)
        new.__dict__.update(self.__dict__)
        new.owned, new.empty, new.heap = set(self.owned), set(self.empty), self.heap.copy()
        new._rank = seg_rank
        return new

    def key(self, seg: int) -> int:
        return self._rank[seg] * self._nseg + seg

    def push(self, seg: int, seg_key: list[int]) -> None:
        """``seg`` (owned) has a free unit again, or was just acquired."""
        key = seg_key[seg] = self._rank[seg] * self._nseg + seg
        heapq.heappush(self.heap, key)
        if len(self.heap) > 4 * len(self.owned) + 16:
            # Stale entries (segments that changed hands back and forth) outnumber the live
            # ones: rebuild from the valid keys; amortised O(1).
            self.heap = sorted({k for k in self.heap if seg_key[k % self._nseg] == k})

    def fill_order(self, segs) -> list[int]:
        """``segs`` in the order this pool fills them (oldest first)."""
        return sorted(segs, key=self.key)

    def min_segments(self) -> int:
        """Segments the live units need once packed."""
        return -(-self.live // self.units_per_segment)
