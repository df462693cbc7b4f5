"""The host record of the arena's segments, which the allocator and the migrator change and the
policies read.

A unit is addressed by its slot ``segment * max_units + unit`` (``max_units``: the most units
any pool fits in a segment). Per segment the map keeps the owning pool (-1: unowned), its live
units, its rank (acquisition order, pools.py), the key under which it is validly in its owner's
heap (-1: none) and the stack of its free slots (the next one taken is the last); per group
(a policy's partition of the segments, policies.py) the unowned segments, lowest first.
Everything here is plain Python lists and sets: the allocation path does no numpy or jax work.
"""

from __future__ import annotations

from serving.memory.pools import Pool


class _StacksCopiedOnFirstUse(dict):
    """Free-slot stacks of a scratch map: ``stacks[segment]`` is a copy of the original map's
    stack, made the first time the segment is looked up; the original is never changed."""

    def __init__(self, original: list[list[int]]):
        super().__init__()
        self._original = original

    def __missing__(self, seg: int) -> list[int]:
        stack = self[seg] = self._original[seg].copy()
        return stack


class SegmentMap:
    """Owner, live units, rank, heap key and free slots of every segment; the pools; the
    unowned segments of each group.

    Args:
      pools: ``(name, unit words, group)`` of each pool, in pool index order.
      segment_words: words per segment.
      seg_groups: the group of each segment (a pool only ever owns segments of its group).
    """

    def __init__(
        self, pools: list[tuple[str, int, int]], segment_words: int, seg_groups: list[int]
    ):
        num_segments = self.num_segments = len(seg_groups)
        self.seg_owner = [-1] * num_segments
        self.seg_live = [0] * num_segments
        self.seg_rank = [0] * num_segments
        self.seg_key = [-1] * num_segments  # valid heap key of the segment (pools.py)
        self.next_rank = 0
        self.pools = [
            Pool(i, name, words, segment_words // words, group, self.seg_rank)
            for i, (name, words, group) in enumerate(pools)
        ]
        self.max_units = max(p.units_per_segment for p in self.pools)
        self.seg_free: list[list[int]] = [[] for _ in range(num_segments)]
        self.seg_group = seg_groups
        self.unowned = [
            [s for s in range(num_segments) if seg_groups[s] == g]
            for g in range(max(seg_groups) + 1)
        ]
        self.group_size = [len(u) for u in self.unowned]

    def scratch(self) -> SegmentMap:
        """A copy to run allocations on without changing this map (``fits_all``): the
        per-segment lists, the unowned lists and the pools are copied (O(segments)); a
        segment's free-slot stack is copied only when the run first looks it up."""
        new = object.__new__(SegmentMap)
        new.__dict__.update(self.__dict__)
        new.seg_owner = self.seg_owner.copy()
        new.seg_live = self.seg_live.copy()
        new.seg_rank = self.seg_rank.copy()
        new.seg_key = self.seg_key.copy()
        new.seg_free = _StacksCopiedOnFirstUse(self.seg_free)
        new.unowned = [u.copy() for u in self.unowned]
        new.pools = [p.copy(new.seg_rank) for p in self.pools]
        return new
