"""Taking units of a pool, returning them, and deciding where they come from.

A pool with enough free units gives them oldest segment first (pools.py), a whole segment's
worth at a time (slices of the free-slot stacks; the next segment comes from the pool's heap).
A pool with too few asks the policy (policies.py) for whole segments, has the migrator hand them
over (migration.py) and fills them in plan order. Nothing changes when the policy has no plan.

Whether allocations would succeed is answered by this same code: :meth:`Allocator.fits` asks
the policy for the plan :meth:`Allocator.take` would execute, and :meth:`Allocator.fits_all`
runs the allocations themselves, in order, on a scratch copy of the segment map
(:meth:`SegmentMap.scratch`) with a migrator that copies nothing.
"""

from __future__ import annotations

import heapq

from serving.memory.migration import Migrator
from serving.memory.policies import Policy
from serving.memory.pools import Pool
from serving.memory.segments import SegmentMap


class Allocator:
    """Free units of every pool, as slots of a :class:`SegmentMap`: takes them for an
    allocation (acquiring segments through the policy and the migrator when a pool runs short)
    and takes them back. Same calls, same slots: every choice is a heap or an ordered scan."""

    def __init__(self, segments: SegmentMap, policy: Policy, migrator: Migrator):
        self.segments = segments
        self.policy = policy
        self.migrator = migrator

    # ------------------------------------------------------------------------------ answers

    def capacity(self, pool: Pool) -> int:
        """Most units ``pool`` could ever hold at once (every segment of its group)."""
        return self.segments.group_size[pool.group] * pool.units_per_segment

    def shortfall(self, pool: Pool, n: int) -> int:
        """Whole segments ``pool`` lacks for ``n`` more units."""
        return -(-(n - pool.free_units) // pool.units_per_segment)

    def plan(self, pool: Pool, n: int) -> list[int] | None:
        """The segments :meth:`take` would acquire for ``n`` units of ``pool`` (``[]``: it
        has them), or ``None`` when they do not fit now."""
        if pool.free_units >= n:
            return []
        if n > self.capacity(pool):
            return None
        return self.policy.plan(self.segments, pool, self.shortfall(pool, n))

    def fits(self, pool: Pool, n: int) -> bool:
        """Whether :meth:`take` of ``n`` units of ``pool`` would succeed now."""
        return self.plan(pool, n) is not None

    def fits_all(self, needs: list[tuple[Pool, int]]) -> bool:
        """Whether taking every ``(pool, n)`` of ``needs``, in order, would succeed now: the
        same takes, run on a scratch copy of the segment map (nothing here changes)."""
        total: dict[int, int] = {}
        for pool, n in needs:
            total[pool.index] = total.get(pool.index, 0) + n
        pools = self.segments.pools
        if all(pools[i].free_units >= n for i, n in total.items()):
            return True  # every take is served by free units: none can fail
        if any(n > self.capacity(pools[i]) for i, n in total.items()):
            return False  # more than the pool could ever hold: some take must fail
        trial = self.trial()
        mine = trial.segments.pools
        return all(trial.take(mine[pool.index], n) is not None for pool, n in needs if n)

    def trial(self) -> Allocator:
        """An allocator over a scratch copy of the segment map, with a migrator that moves
        units on that copy only (no handles, no device)."""
        scratch = self.segments.scratch()
        return Allocator(scratch, self.policy, Migrator(scratch))

    # ------------------------------------------------------------------------- take, return

    def take(self, pool: Pool, n: int) -> list[int] | None:
        """Take ``n`` units of ``pool``; return their slots, or ``None`` (nothing changed)
        when they do not fit now, even after migration."""
        if pool.free_units >= n:
            return self._take_free(pool, n)
        segs = self.plan(pool, n)
        if segs is None:
            return None
        return self._acquire_and_take(pool, segs, n)

    def give_back(self, slots: list[int]) -> None:
        """Return the units at ``slots`` to their segments' free stacks."""
        sm = self.segments
        seg_live, seg_free, seg_owner, pools = sm.seg_live, sm.seg_free, sm.seg_owner, sm.pools
        seg_key, stride = sm.seg_key, sm.max_units
        for slot in slots:
            seg = slot // stride
            pool = pools[seg_owner[seg]]
            free = seg_free[seg]
            if not free:
                pool.push(seg, seg_key)
            free.append(slot)
            live = seg_live[seg] - 1
            seg_live[seg] = live
            if live == 0:
                pool.empty.add(seg)
            pool.live -= 1
            pool.free_units += 1

    def _take_free(self, pool: Pool, n: int) -> list[int]:
        """Take ``n`` free units of ``pool`` (the caller made sure they exist), oldest
        segment first, a whole segment's worth at a time (slices of the free stacks)."""
        sm = self.segments
        seg_live, seg_free, seg_key = sm.seg_live, sm.seg_free, sm.seg_key
        heap, nseg, ups = pool.heap, sm.num_segments, pool.units_per_segment
        if n == 1:
            key = heap[0]
            seg = key % nseg
            while seg_key[seg] != key:  # stale entry (see Pool)
                heapq.heappop(heap)
                key = heap[0]
                seg = key % nseg
            live = seg_live[seg]
            if live == 0:
                pool.empty.discard(seg)
            seg_live[seg] = live + 1
            if live + 1 == ups:
                heapq.heappop(heap)
                seg_key[seg] = -1
            slots = [seg_free[seg].pop()]
        else:
            # Whole segments at a time, in the pool's fill order (heap order): each one's free
            # stack from the top.
            heappop, empty, left = heapq.heappop, pool.empty, n
            slots = []
            if ups == 1:  # one unit per segment (state slots): each segment leaves the heap
                for _ in range(n):
                    key = heappop(heap)
                    seg = key % nseg
                    while seg_key[seg] != key:  # stale entry (see Pool)
                        key = heappop(heap)
                        seg = key % nseg
                    seg_key[seg] = -1
                    seg_live[seg] = 1
                    empty.discard(seg)
                    slots += seg_free[seg]
                    seg_free[seg] = []
            else:
                while left:
                    key = heap[0]
                    seg = key % nseg
                    while seg_key[seg] != key:  # stale entry (see Pool)
                        heappop(heap)
                        key = heap[0]
                        seg = key % nseg
                    live = seg_live[seg]
                    if live == 0:
                        empty.discard(seg)
                    free = seg_free[seg]
                    if left >= ups - live:  # the rest of the segment
                        heappop(heap)
                        seg_key[seg] = -1
                        seg_live[seg] = ups
                        left -= ups - live
                        free.reverse()  # top of the stack first
                        slots += free
                        seg_free[seg] = []
                    else:
                        seg_live[seg] = live + left
                        slots += free[: -left - 1 : -1]  # the top ``left``, top first
                        del free[-left:]
                        left = 0
        pool.live += n
        pool.free_units -= n
        return slots

    def _acquire_and_take(self, pool: Pool, segs: list[int], n: int) -> list[int]:
        """Have the migrator give ``segs`` to ``pool``, then take ``n`` units.

        A minimal plan of other pools' or unowned segments (what the policies return) is
        filled in one pass (:meth:`_fill_acquired`); any other plan through the general path:
        the segments join the pool with every unit free (:meth:`_add_fresh`), then
        :meth:`_take_free`. Both leave the same layout."""
        owner, index = self.segments.seg_owner, pool.index
        foreign = index not in [owner[s] for s in segs]
        minimal = foreign and len(segs) == self.shortfall(pool, n)
        self.migrator.transfer(pool, segs)
        if minimal:
            return self._fill_acquired(pool, segs, n)
        self._add_fresh(pool, segs)
        return self._take_free(pool, n)

    def _add_fresh(self, pool: Pool, segs: list[int]) -> None:
        """Segments just given to ``pool`` enter it with every unit free (unit 0 on top of the
        stack) and in its heap."""
        sm, ups = self.segments, pool.units_per_segment
        stride, seg_free, seg_key = sm.max_units, sm.seg_free, sm.seg_key
        for s in segs:
            base = s * stride
            seg_free[s] = list(range(base + ups - 1, base - 1, -1))
            pool.push(s, seg_key)
        pool.empty.update(segs)
        pool.free_units += ups * len(segs)

    def _fill_acquired(self, pool: Pool, segs: list[int], n: int) -> list[int]:
        """:meth:`_add_fresh` then :meth:`_take_free` of ``n`` units, with the same result,
        batched: the pool's free units all come first (its other segments rank below any new
        one), then the new segments in plan order (their ranks), each filled whole but the last,
        which a minimal plan leaves with at least one unit. So the new segments never enter
        ``empty`` and only the last one, if it keeps a free unit, enters the heap."""
        sm = self.segments
        seg_live, seg_free, seg_key, stride = sm.seg_live, sm.seg_free, sm.seg_key, sm.max_units
        free, ups = pool.free_units, pool.units_per_segment
        slots: list[int] = []
        if free:
            # Every free unit of the pool goes: the segments with a valid heap entry, in key
            # order, each emptied of its free stack (top first); the heap keeps only stale
            # entries, so it is dropped whole.
            heap, nseg = pool.heap, sm.num_segments
            taken = [k % nseg for k in sorted({k for k in heap if seg_key[k % nseg] == k})]
            for seg in taken:
                slots += seg_free[seg][::-1]
                seg_free[seg] = []
                seg_live[seg] = ups
                seg_key[seg] = -1
            pool.empty.difference_update(taken)
            heap.clear()
        last = segs[-1]
        for s in segs[:-1]:
            base = s * stride
            slots += range(base, base + ups)  # unit 0 first, as from a fresh stack
            seg_live[s] = ups
            seg_free[s] = []
        base = last * stride
        k = n - free - ups * (len(segs) - 1)
        slots += range(base, base + k)
        seg_live[last] = k
        if k < ups:
            seg_free[last] = list(range(base + ups - 1, base + k - 1, -1))
            pool.push(last, seg_key)
        else:
            seg_free[last] = []
        pool.live += n
        pool.free_units = free + ups * len(segs) - n
        return slots
