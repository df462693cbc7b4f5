"""Host-side bookkeeping of one pool: which segments it owns and where its free units are.

A pool holds units of one size (``unit_words``); each of its segments holds
``units_per_segment`` of them (the segment tail that no whole unit fills stays unused).
Within a pool every free unit serves every allocation, so a pool never needs compaction for
itself; compaction only moves units so that whole segments can change pool.
"""

from __future__ import annotations

import heapq


class Pool:
    """Segments owned by one pool, with a lazy min-heap of segments that have free units.

    The heap may hold stale entries (segments since given away, or full); :meth:`segment_with_free`
    drops them as it meets them, which keeps the allocation path O(log S) without bookkeeping
    on every ownership change.
    """

    def __init__(self, index: int, name: str, unit_words: int, units_per_segment: int,
                 group: int):
        self.index = index
        self.name = name
        self.unit_words = unit_words
        self.units_per_segment = units_per_segment
        self.group = group
        self.owned: set[int] = set()
        self.empty: set[int] = set()  # owned segments with no live unit
        self.live = 0
        self.free_units = 0
        self._heap: list[int] = []

    def push(self, seg: int) -> None:
        heapq.heappush(self._heap, seg)

    def segment_with_free(self, seg_owner: list[int], seg_free: list[list[int]]) -> int:
        """Lowest owned segment with a free unit (the caller checked ``free_units > 0``)."""
        heap = self._heap
        while True:
            seg = heap[0]
            if seg_owner[seg] == self.index and seg_free[seg]:
                return seg
            heapq.heappop(heap)

    def pop_if_full(self, seg: int, seg_free: list[list[int]]) -> None:
        if not seg_free[seg] and self._heap and self._heap[0] == seg:
            heapq.heappop(self._heap)

    def min_segments(self) -> int:
        """Segments the live units need once packed."""
        return -(-self.live // self.units_per_segment)
