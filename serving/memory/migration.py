"""Handing whole segments from one pool (or from the unowned ones) to another.

A segment that still holds live units of another pool is emptied first: its units move into
free units of that pool's other segments, in the pool's fill order, with one jitted, donated
copy per victim pool (``Arena.move``), and their handles are pointed at the new places (the
handles themselves never change). Handing over a wholly free segment moves no data: it is host
bookkeeping only, no device call at all.
"""

from __future__ import annotations

from serving.memory.arena import Arena
from serving.memory.handles import HandleTable
from serving.memory.layout import WORD_BYTES
from serving.memory.pools import Pool
from serving.memory.segments import SegmentMap


class Migrator:
    """Moves segments between pools on a :class:`SegmentMap`, and the live units out of them.

    Counts the segments taken from other pools (``migrations``), the bytes of the units moved
    (``migrated_bytes``) and the copy calls (``compactions``). Without a handle table and an
    arena (a trial run on a scratch map, :meth:`Allocator.fits_all`) it changes the map exactly
    as for real and copies nothing.
    """

    def __init__(
        self, segments: SegmentMap, handles: HandleTable | None = None, arena: Arena | None = None
    ):
        self.segments = segments
        self.handles = handles
        self.arena = arena
        self.migrations = 0
        self.migrated_bytes = 0
        self.compactions = 0

    def transfer(self, pool: Pool, segs: list[int]) -> None:
        """Give segments ``segs`` (a policy's plan) to ``pool``, in plan order.

        Their live units of other pools are moved out first; then each leaves its old owner
        (the unowned list of its group, or a pool: owned, empty and free units), gets ``pool``
        as owner and the next rank, and leaves every heap. Setting up their free slots and
        filling them is the allocator's part.
        """
        sm = self.segments
        seg_owner, seg_live = sm.seg_owner, sm.seg_live
        busy = [s for s in segs if seg_live[s]]
        if busy:
            taking = set(segs)
            for victim in sm.pools:
                moving = [s for s in busy if seg_owner[s] == victim.index]
                if moving and victim is not pool:
                    self._evacuate(victim, moving, taking)
        from_unowned = [s for s in segs if seg_owner[s] == -1]
        if from_unowned:
            group, k = sm.unowned[pool.group], len(from_unowned)
            if group[:k] == from_unowned:  # the policies take a prefix
                del group[:k]
            else:
                for s in from_unowned:
                    sm.unowned[sm.seg_group[s]].remove(s)
        pools, rank, seg_key, index = sm.pools, sm.seg_rank, sm.seg_key, pool.index
        r = sm.next_rank
        for s in segs:
            old = seg_owner[s]
            if old != -1:
                victim = pools[old]
                victim.owned.discard(s)
                victim.empty.discard(s)
                victim.free_units -= victim.units_per_segment
                self.migrations += 1
            seg_owner[s] = index
            rank[s] = r
            r += 1
            seg_key[s] = -1  # entries in the old owner's heap go stale
        sm.next_rank = r
        pool.owned.update(segs)

    def _evacuate(self, pool: Pool, segs: list[int], excluded: set[int]) -> None:
        """Move every live unit of ``segs`` into free units of ``pool``'s other segments
        (not in ``excluded``), in the pool's fill order: one device copy for the whole batch."""
        sm = self.segments
        seg_live, seg_free, seg_key = sm.seg_live, sm.seg_free, sm.seg_key
        ups, empty = pool.units_per_segment, pool.empty
        count = left = sum(seg_live[s] for s in segs)
        dests: list[int] = []
        for dest in pool.fill_order(pool.owned - excluded):
            live = seg_live[dest]
            if live == ups:
                continue
            k = min(left, ups - live)
            free = seg_free[dest]
            dests += free[: -k - 1 : -1]  # the top ``k`` of its free stack, top first
            del free[-k:]
            if live == 0:
                empty.discard(dest)
            seg_live[dest] = live + k
            if live + k == ups:
                seg_key[dest] = -1  # full: its heap entry goes stale
            left -= k
            if not left:
                break
        if left:
            raise RuntimeError(f"pool {pool.name!r} has no room for the {count} units to move")
        for s in segs:
            seg_live[s] = 0
            empty.add(s)
        words = pool.unit_words
        if self.handles is not None:
            stride = sm.max_units
            src = self.handles.relocate(segs, dests)
            moves = [
                (a // stride, a % stride * words, b // stride, b % stride * words)
                for a, b in zip(src, dests, strict=True)
            ]
            self.arena.move(moves, words)
        self.migrated_bytes += count * words * WORD_BYTES
        self.compactions += 1
