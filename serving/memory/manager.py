"""The memory manager: virtual handles over one device arena (DESIGN.md section 6).

Requests hold stable integer handles. A handle maps to a physical ``(segment, word)``; the host
bookkeeping is authoritative and the ``[H, 2]`` translation table is derived from it (host
numpy copy ``_table``, device copy :meth:`MemoryManager.device_table`) for kernels to read
through.

Allocation path (host only, no device work): take free units of the kind's pool; if there are
too few, ask the policy for a plan of whole segments to acquire, move the live units out of
those segments on device (one jitted, donated copy per victim pool), update the handles, and
reassign the segments. Re-assigning a wholly free segment is host bookkeeping only: no device
call at all. Migration therefore happens only when an allocation would fail, and the same
sequence of calls always produces the same layout (no clocks, no hashing of ids: heaps and
ordered scans make every choice).

Host cost: the allocation path does no numpy or jax work. Per handle it keeps a slot
(``segment * max_units + unit``) and an owner ``(request, kind)`` in Python lists; free units
are per-segment stacks and free handles one stack, taken and returned by slices; a pool finds
its next segment in a heap. An allocation that acquires segments is batched
(``_acquire_and_take``): it takes every free unit the pool had, then fills the new segments in
plan order, so they get their final state at once instead of entering the pool's heap and
``empty`` set only to leave them again (the same layout, with a fraction of the per-segment
work). The translation table is brought up to date in one batch, from the handles changed since
the last time, only when it is read.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
from jax import numpy as jnp

from serving.memory.arena import Arena
from serving.memory.errors import (
    AllocationTooLargeError,
    DoubleFreeError,
    HandleKindError,
    OutOfMemoryError,
    UnknownHandleError,
    UnknownKindError,
    UnknownRequestError,
)
from serving.memory.layout import KINDS, WORD_BYTES, Field, HybridLayout
from serving.memory.policies import Policy, make_policy
from serving.memory.pools import Pool

DEFAULT_SEGMENT_BYTES = 2 << 20
# Small budgets get smaller segments, so pools can still trade: a pool wastes at most one
# partly filled segment, i.e. about 1/MIN_AUTO_SEGMENTS of the arena (never below one unit).
MIN_AUTO_SEGMENTS = 32
# A default segment may make a unit cost this much more than unified_padded's page does.
SEGMENT_COST_SLACK = 0.01
_INTS = (int, np.integer)  # a tuple: ``int | np.integer`` would build a union on every call


def _budget_from_fraction(fraction: float, device: jax.Device) -> int:
    stats = device.memory_stats()
    if not stats or "bytes_limit" not in stats:
        raise ValueError(
            f"budget_bytes={fraction} is a fraction of free device memory, but {device} does "
            "not report memory_stats(); pass a byte count")
    return int(fraction * (stats["bytes_limit"] - stats.get("bytes_in_use", 0)))


def _default_segment_words(units: Mapping[str, int], budget_words: int) -> int:
    """Segment size (words) for pools of unit sizes ``units`` (pool name -> words).

    The yardstick is the padded page: the smallest whole number of KV pages that holds the
    largest unit (the page ``unified_padded`` uses). The aim is ``m`` padded pages, ``m`` the
    largest count at or below about ``min(2 MiB, budget / MIN_AUTO_SEGMENTS)`` (at least 1), so
    that small arenas keep many segments and pools trade finely (a pool wastes at most one
    partly filled segment). Candidates are that size and every multiple of a unit size between
    ``m`` largest units and it; a candidate qualifies when no kind of unit costs more arena
    bytes in it (segment / units per segment) than in ``unified_padded`` (a padded page per
    state, snapshot or stash, a KV page per KV page), up to ``SEGMENT_COST_SLACK``. The
    qualifying candidate that gives the most whole segments of the budget wins (ties: the
    larger). So no kind ever packs worse than in the padded page, smaller units (a stash beside
    a state slot) pack several per page, and a budget that is a whole number of state slots is
    not cut to one segment fewer (Qwen3.5: a segment of exactly one state slot, whose 98 KV
    pages cost 0.25% more each than in the padded page of 99).

    Not a criterion any more, after the study (benchmarks/README.md, session 6): the share of a
    segment the worst pool can fill. That picked 60 KiB segments for the tiny model (2 stashes
    exactly, but a state slot 87.5% full against the padded page's 93.75%), and AVMP lost 18
    tiny cells to ``unified_padded``, mostly snapshot cells, whose memory is state slots.
    A budget below one padded page gets one segment of the largest unit. Deterministic.
    """
    biggest = max(units.values())
    page = units.get("kv", min(units.values()))
    padded = page * -(-biggest // page)
    if padded > budget_words:
        return biggest
    aim = min(DEFAULT_SEGMENT_BYTES, budget_words * WORD_BYTES // MIN_AUTO_SEGMENTS) // WORD_BYTES
    m = max(1, aim // padded)
    top = m * padded
    # the most arena bytes one unit of each pool may cost (every candidate >= biggest >= u)
    cap = {n: (page if n == "kv" else padded) * (1 + SEGMENT_COST_SLACK) for n in units}
    candidates = {top}
    for u in set(units.values()):
        candidates.update(range(-(-m * biggest // u) * u, top, u))

    def qualifies(seg: int) -> bool:
        return all(seg / (seg // u) <= cap[n] for n, u in units.items())

    return max((s for s in candidates if qualifies(s)), key=lambda s: (budget_words // s, s))


class _ShadowPool:
    """What a policy reads of a :class:`Pool`, copied so a dry run can change it."""

    def __init__(self, p: Pool, shadow: _Shadow):
        self.index, self.name, self.group = p.index, p.name, p.group
        self.unit_words, self.units_per_segment = p.unit_words, p.units_per_segment
        self.owned, self.empty = set(p.owned), set(p.empty)
        self.live, self.free_units = p.live, p.free_units
        self._shadow = shadow

    def fill_order(self, segs) -> list[int]:
        rank, n = self._shadow.seg_rank, self._shadow.num_segments
        return sorted(segs, key=lambda s: rank[s] * n + s)

    def min_segments(self) -> int:
        return -(-self.live // self.units_per_segment)


class _Shadow:
    """Host bookkeeping copied for :meth:`MemoryManager.fits_all`: replays allocations exactly
    as the manager would (same plans, same evacuation targets, same unit placement) without
    touching the manager or the device."""

    def __init__(self, mm: MemoryManager):
        self.policy = mm.policy
        self.num_segments = mm.num_segments
        self.seg_owner = list(mm.seg_owner)
        self.seg_live = list(mm.seg_live)
        self.seg_rank = list(mm.seg_rank)
        self.next_rank = mm._next_rank
        self.seg_group = mm.seg_group
        self.unowned = [list(u) for u in mm.unowned]
        self.pools = [_ShadowPool(p, self) for p in mm.pools]

    def alloc(self, pool: _ShadowPool, n: int) -> bool:
        live, ups = self.seg_live, pool.units_per_segment

        def place(p, segs, count):
            """Fill ``count`` units into ``segs`` of pool ``p`` in its fill order (only the
            segments with room are ordered: the others take nothing)."""
            if not count:
                return
            u = p.units_per_segment
            for dest in p.fill_order([s for s in segs if live[s] < u]):
                k = min(count, u - live[dest])
                if live[dest] == 0:
                    p.empty.discard(dest)
                live[dest] += k
                count -= k
                if not count:
                    break

        if pool.free_units < n:
            need = -(-(n - pool.free_units) // ups)
            plan = self.policy.plan(self, pool, need)
            if plan is None:
                return False
            taking = set(plan)
            for victim in self.pools:
                moving = [s for s in plan if self.seg_owner[s] == victim.index and live[s]]
                if victim is pool or not moving:
                    continue
                place(victim, victim.owned - taking, sum(live[s] for s in moving))
                for s in moving:
                    live[s] = 0
            for s in plan:
                old = self.seg_owner[s]
                if old == -1:
                    self.unowned[self.seg_group[s]].remove(s)
                else:
                    victim = self.pools[old]
                    victim.owned.discard(s)
                    victim.empty.discard(s)
                    victim.free_units -= victim.units_per_segment
                self.seg_owner[s] = pool.index
                self.seg_rank[s] = self.next_rank
                self.next_rank += 1
                pool.owned.add(s)
                pool.empty.add(s)
                pool.free_units += ups
        place(pool, pool.owned, n)
        pool.live += n
        pool.free_units -= n
        return True


class MemoryManager:
    """Asymmetric paged memory for hybrid caches.

    Args:
      layout: unit geometry (:func:`serving.memory.layout_for`).
      budget_bytes: arena size in bytes (int), or a fraction in (0, 1] of free device memory.
        The arena is the largest whole number of segments that fits; the rest is unused
        (``stats()["unused_budget_bytes"]``).
      policy: ``"avmp"`` | ``"unified_padded"`` | ``"static_dual"`` | ``"multi_ended"``.
      segment_bytes: segment size. Default: about min(2 MiB, budget / 32), at least one
        padded page (the KV pages that hold the largest unit: ``unified_padded``'s page), such
        that no kind of unit costs more arena bytes than in that page (1% slack), and giving
        the most whole segments of the budget (:func:`_default_segment_words`).
      device: where the arena lives (default: first device).
      **policy_args: e.g. ``ratio=0.9`` for ``static_dual``.
    """

    def __init__(self, layout: HybridLayout, budget_bytes: int | float, policy: str = "avmp",
                 *, segment_bytes: int | None = None, device: jax.Device | None = None,
                 **policy_args: Any):
        if not isinstance(layout, HybridLayout):
            raise ValueError(f"layout must be a HybridLayout, got {type(layout).__name__}")
        device = device or jax.devices()[0]
        if isinstance(budget_bytes, float):
            if not 0 < budget_bytes <= 1:
                raise ValueError(f"budget_bytes as a fraction must be in (0, 1], got {budget_bytes}")
            budget_bytes = _budget_from_fraction(budget_bytes, device)
        if not isinstance(budget_bytes, int | np.integer) or budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
        self.policy: Policy = make_policy(policy, **policy_args)
        self.natural_layout = layout
        self.layout = self.policy.effective_layout(layout)
        self.budget_bytes = int(budget_bytes)
        self._pool_of_kind = self.policy.pool_of_kind(self.layout)
        self._fields = {k: {f.name: f for f in self.layout.fields(k)} for k in KINDS}
        self._default_field = {k: self.layout.fields(k)[0] for k in KINDS}
        self._unit_words = {k: self.layout.unit_words(k) for k in KINDS}

        names = list(dict.fromkeys(self._pool_of_kind.values()))
        unit_words = {n: max(self.layout.unit_words(k) for k in KINDS
                             if self._pool_of_kind[k] == n) for n in names}
        biggest = max(unit_words.values())
        if segment_bytes is None:
            seg_words = _default_segment_words(unit_words, self.budget_bytes // WORD_BYTES)
        else:
            if segment_bytes % WORD_BYTES or segment_bytes < biggest * WORD_BYTES:
                raise ValueError(
                    f"segment_bytes must be a multiple of {WORD_BYTES} and >= the largest unit "
                    f"({biggest * WORD_BYTES} bytes), got {segment_bytes}")
            seg_words = segment_bytes // WORD_BYTES
        num_segments = self.budget_bytes // (seg_words * WORD_BYTES)
        if num_segments < 1:
            raise ValueError(
                f"budget_bytes={self.budget_bytes} is smaller than one segment "
                f"({seg_words * WORD_BYTES} bytes)")
        pool_groups, seg_groups = self.policy.pool_groups(names, num_segments)
        # Per segment: owning pool (-1: unowned), live units, rank (acquisition order, see
        # pools.py), and a stack of its free slots (slot = segment * max_units + unit; the
        # next one taken is the last).
        self.seg_owner = [-1] * num_segments
        self.seg_live = [0] * num_segments
        self.seg_rank = [0] * num_segments
        self._seg_key = [-1] * num_segments  # valid heap key of the segment (pools.py)
        self._next_rank = 0
        self.pools = [Pool(i, n, unit_words[n], seg_words // unit_words[n], pool_groups[i],
                           self.seg_rank)
                      for i, n in enumerate(names)]
        self._pool_by_name = {p.name: p for p in self.pools}
        self._kind_pool = {k: self._pool_by_name[self._pool_of_kind[k]] for k in KINDS}
        self._kind_id = {k: i for i, k in enumerate(KINDS)}
        self.num_segments = num_segments
        self.arena = Arena(num_segments, seg_words, device=device)

        self._max_units = max_units = max(p.units_per_segment for p in self.pools)
        self.seg_free: list[list[int]] = [[] for _ in range(num_segments)]
        self.seg_group = seg_groups
        self.unowned = [[s for s in range(num_segments) if seg_groups[s] == g]
                        for g in range(max(seg_groups) + 1)]
        self._group_size = [len(u) for u in self.unowned]

        # Per handle: slot (-1: freed, -2: never issued) and owner ``(request, kind id)`` (None:
        # not live). Free handles form a stack; never-used ones come out lowest first. A
        # request's handles are a list in allocation order. The numpy table follows lazily:
        # ``_dirty`` lists the handles changed since it was last brought up to date (``None``:
        # too many, rebuild it whole).
        self._capacity = num_segments * max_units
        self._table_np = np.full((self._capacity, 2), -1, np.int32)
        self._dirty: list[int] | None = []
        self._device_table: jax.Array | None = None
        self._h_slot = [-2] * self._capacity
        self._h_owner: list[tuple[Hashable, int] | None] = [None] * self._capacity
        self._free_handles = list(range(self._capacity - 1, -1, -1))
        self._requests: dict[Hashable, list[int]] = {}
        self._retired: set[Hashable] = set()
        self._live_count = [0] * len(KINDS)  # live units per kind id
        self.migrations = 0
        self.migrated_bytes = 0
        self.compactions = 0

    # ----------------------------------------------------------------------------- allocation

    def _pool_for(self, kind: str) -> Pool:
        try:
            return self._kind_pool[kind]
        except (KeyError, TypeError):
            raise UnknownKindError(f"kind must be one of {KINDS}, got {kind!r}") from None

    def capacity(self, kind: str) -> int:
        """Most units of ``kind`` this policy could ever hold at once (everything else empty)."""
        pool = self._pool_for(kind)
        return self._group_size[pool.group] * pool.units_per_segment

    def fits(self, kind: str, n: int = 1) -> bool:
        """Whether ``alloc(_, kind, n)`` would succeed now (a dry run: nothing changes)."""
        pool = self._pool_for(kind)
        if not isinstance(n, _INTS) or isinstance(n, bool) or n < 1:
            raise ValueError(f"n must be a positive int, got {n!r}")
        if pool.free_units >= n:
            return True
        if n > self._group_size[pool.group] * pool.units_per_segment:
            return False
        need = -(-(n - pool.free_units) // pool.units_per_segment)
        return self.policy.plan(self, pool, need) is not None

    def fits_all(self, needs: Mapping[str, int] | Iterable[tuple[str, int]]) -> bool:
        """Whether allocating every ``(kind, n)`` of ``needs``, in order, would succeed now.

        A dry run of the whole sequence (nothing changes): unlike separate :meth:`fits` calls,
        it never counts one free segment for two kinds. ``n == 0`` entries are skipped.
        """
        items = list(needs.items() if isinstance(needs, Mapping) else needs)
        total: dict[int, int] = {}
        for kind, n in items:
            pool = self._pool_for(kind)
            if not isinstance(n, _INTS) or isinstance(n, bool) or n < 0:
                raise ValueError(f"n must be a non-negative int, got {n!r} for kind {kind!r}")
            total[pool.index] = total.get(pool.index, 0) + int(n)
        if all(self.pools[i].free_units >= n for i, n in total.items()):
            return True  # no pool needs a segment: nothing can collide
        for i, n in total.items():
            pool = self.pools[i]
            if n > self._group_size[pool.group] * pool.units_per_segment:
                return False
        shadow = _Shadow(self)
        return all(shadow.alloc(shadow.pools[self._pool_for(k).index], int(n))
                   for k, n in items if n)

    def alloc(self, request_id: Hashable, kind: str, n: int = 1) -> list[int]:
        """Allocate ``n`` units of ``kind`` for ``request_id``; return their handles.

        Raises:
          OutOfMemoryError: they do not fit now, even after migration (nothing changed).
          AllocationTooLargeError: they could not fit even in an empty arena.
          UnknownKindError / ValueError: bad ``kind`` or ``n``.
        """
        try:
            pool = self._kind_pool[kind]
        except (KeyError, TypeError):
            raise UnknownKindError(f"kind must be one of {KINDS}, got {kind!r}") from None
        if type(n) is not int:
            if not isinstance(n, _INTS) or isinstance(n, bool):
                raise ValueError(f"n must be a positive int, got {n!r}")
            n = int(n)
        if n < 1:
            raise ValueError(f"n must be a positive int, got {n!r}")
        if pool.free_units < n:
            if n > self._group_size[pool.group] * pool.units_per_segment:
                raise AllocationTooLargeError(
                    f"n={n} units of kind {kind!r} exceed the arena's capacity under policy "
                    f"{self.policy.name!r} ({self.capacity(kind)} units)")
            need = -(-(n - pool.free_units) // pool.units_per_segment)
            plan = self.policy.plan(self, pool, need)
            if plan is None:
                raise OutOfMemoryError(
                    f"cannot allocate n={n} units of kind {kind!r} for request {request_id!r}: "
                    f"{pool.free_units} free in its pool and no {need} segment(s) to migrate")
            kind_id = self._kind_id[kind]
            out = self._acquire_and_take(pool, plan, (request_id, kind_id), n)
        else:
            kind_id = self._kind_id[kind]
            out = self._take_units(pool, (request_id, kind_id), n)
        held = self._requests.get(request_id)
        if held is None:
            self._requests[request_id] = out.copy()
            self._retired.discard(request_id)
        else:
            held += out
        self._live_count[kind_id] += n
        self._device_table = None
        return out

    def _take_units(self, pool: Pool, owner: tuple[Hashable, int], n: int) -> list[int]:
        """Take ``n`` free units of ``pool`` (the caller made sure they exist), oldest
        segment first, a whole segment's worth at a time (slices of the free stacks)."""
        free_handles, h_slot = self._free_handles, self._h_slot
        out = free_handles[-n:]
        del free_handles[-n:]
        out.reverse()  # never-used handles come out lowest first
        if n == 1:
            seg_live, seg_key, heap = self.seg_live, self._seg_key, pool.heap
            nseg = self.num_segments
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
            if live + 1 == pool.units_per_segment:
                heapq.heappop(heap)
                seg_key[seg] = -1
            h = out[0]
            h_slot[h] = self.seg_free[seg].pop()
            self._h_owner[h] = owner
        else:
            # Whole segments at a time, in the pool's fill order (heap order): each one's free
            # stack from the top.
            seg_live, seg_free, seg_key = self.seg_live, self.seg_free, self._seg_key
            heap, nseg, ups = pool.heap, self.num_segments, pool.units_per_segment
            heappop, empty, left = heapq.heappop, pool.empty, n
            slots: list[int] = []
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
            self._bind(out, slots, owner)
        self._mark_dirty(out)
        pool.live += n
        pool.free_units -= n
        return out

    def _acquire_and_take(
        self, pool: Pool, segs: list[int], owner: tuple[Hashable, int], n: int
    ) -> list[int]:
        """``_acquire(pool, segs)`` then ``_take_units(pool, owner, n)``, with the same result,
        batched: the pool's ``free`` free units come first (its existing segments rank below
        any new one), then the new segments in plan order (their ranks), each filled whole but
        the last, which a minimal plan leaves with at least one unit. So the new segments
        never enter ``empty`` and only the last one, if it keeps a free unit, enters the heap;
        the others get their final state at once."""
        if n == 1 and len(segs) == 1:
            return self._acquire_one(pool, segs[0], owner)
        free = pool.free_units
        ups, index = pool.units_per_segment, pool.index
        seg_owner, seg_live = self.seg_owner, self.seg_live
        owners = [seg_owner[s] for s in segs]
        if len(segs) != -(-(n - free) // ups) or index in owners:
            self._acquire(pool, segs)  # not a minimal plan of foreign segments: generic path
            return self._take_units(pool, owner, n)
        if any([seg_live[s] for s in segs]):
            taking = set(segs)
            busy = [s for s in segs if seg_live[s]]
            for victim in self.pools:
                moving = [s for s in busy if seg_owner[s] == victim.index]
                if moving:
                    self._evacuate(victim, moving, taking)
        stolen = len(segs)
        if -1 in owners:
            from_unowned = [s for s, o in zip(segs, owners, strict=True) if o == -1]
            stolen -= len(from_unowned)
            group = self.unowned[pool.group]
            if group[: len(from_unowned)] == from_unowned:  # the policies take a prefix
                del group[: len(from_unowned)]
            else:
                for s in from_unowned:
                    self.unowned[self.seg_group[s]].remove(s)
        self.migrations += stolen
        pool.owned.update(segs)

        free_handles = self._free_handles
        out = free_handles[-n:]
        del free_handles[-n:]
        out.reverse()  # never-used handles come out lowest first
        seg_key, seg_free, stride = self._seg_key, self.seg_free, self._max_units
        slots: list[int] = []
        if free:
            # Every free unit of the pool goes: the segments with a valid heap entry, in key
            # order, each emptied of its free stack (top first); the heap keeps only stale
            # entries, so it is dropped whole.
            heap, nseg = pool.heap, self.num_segments
            taken = [k % nseg for k in sorted({k for k in heap if seg_key[k % nseg] == k})]
            for seg in taken:
                slots += seg_free[seg][::-1]
                seg_free[seg] = []
                seg_live[seg] = ups
                seg_key[seg] = -1
            pool.empty.difference_update(taken)
            heap.clear()
        r, rank, last, pools = self._next_rank, self.seg_rank, segs[-1], self.pools
        for s, old in zip(segs, owners, strict=True):
            if old != -1:
                victim = pools[old]
                victim.owned.discard(s)
                victim.empty.discard(s)
                victim.free_units -= victim.units_per_segment
            seg_owner[s] = index
            rank[s] = r
            r += 1
            if s != last:
                base = s * stride
                slots += range(base, base + ups)  # unit 0 first, as from a fresh stack
                seg_live[s] = ups
                seg_free[s] = []
                seg_key[s] = -1  # entries in the old owner's heap go stale
        self._next_rank = r
        base = last * stride
        k = n - free - ups * (len(segs) - 1)
        slots += range(base, base + k)
        seg_live[last] = k
        if k < ups:
            seg_free[last] = list(range(base + ups - 1, base + k - 1, -1))
            pool.push(last, seg_key)
        else:
            seg_free[last] = []
            seg_key[last] = -1
        self._bind(out, slots, owner)
        self._mark_dirty(out)
        pool.live += n
        pool.free_units = free + ups * len(segs) - n
        return out

    def _acquire_one(self, pool: Pool, seg: int, owner: tuple[Hashable, int]) -> list[int]:
        """:meth:`_acquire_and_take` of one unit into one new segment ``seg`` (the pool had no
        free unit): the most common acquisition (a state slot or a stash), unrolled."""
        seg_owner, index = self.seg_owner, pool.index
        old = seg_owner[seg]
        if old == index:  # not a foreign segment: generic path
            self._acquire(pool, [seg])
            return self._take_units(pool, owner, 1)
        if self.seg_live[seg]:
            self._evacuate(self.pools[old], [seg], {seg})
        if old == -1:
            group = self.unowned[pool.group]
            if group[0] == seg:  # the policies take a prefix
                del group[0]
            else:
                self.unowned[self.seg_group[seg]].remove(seg)
        else:
            victim = self.pools[old]
            victim.owned.discard(seg)
            victim.empty.discard(seg)
            victim.free_units -= victim.units_per_segment
            self.migrations += 1
        pool.owned.add(seg)
        seg_owner[seg] = index
        self.seg_rank[seg] = self._next_rank
        self._next_rank += 1
        h = self._free_handles.pop()
        base = seg * self._max_units
        self._h_slot[h] = base  # unit 0, the top of a fresh stack
        self._h_owner[h] = owner
        self.seg_live[seg] = 1
        ups = pool.units_per_segment
        if ups > 1:
            self.seg_free[seg] = list(range(base + ups - 1, base, -1))
            pool.push(seg, self._seg_key)
        else:
            self.seg_free[seg] = []
            self._seg_key[seg] = -1  # entries in the old owner's heap go stale
        self._mark_dirty((h,))
        pool.live += 1
        pool.free_units += ups - 1
        return [h]

    def _bind(self, handles, slots, owner: tuple[Hashable, int]) -> None:
        """Points each of ``handles`` at its slot in ``slots`` and records its owner."""
        h_slot, h_owner = self._h_slot, self._h_owner
        for h, slot in zip(handles, slots, strict=True):
            h_slot[h] = slot
            h_owner[h] = owner

    def _mark_dirty(self, handles) -> None:
        """Queues ``handles`` for the next device-table update (a full upload once the queue
        outgrows twice the capacity)."""
        dirty = self._dirty
        if dirty is not None:
            dirty += handles
            if len(dirty) > 2 * self._capacity:
                self._dirty = None

    def _release(self, victims: list[int]) -> None:
        """Return the units of live handles ``victims`` to their segments' free stacks, the
        handles to the free stack (the last one freed is the next one given out)."""
        h_slot, h_owner, live_count = self._h_slot, self._h_owner, self._live_count
        seg_live, seg_free, seg_owner, pools = self.seg_live, self.seg_free, self.seg_owner, self.pools
        seg_key, stride = self._seg_key, self._max_units
        for h in victims:
            slot = h_slot[h]
            h_slot[h] = -1
            live_count[h_owner[h][1]] -= 1
            h_owner[h] = None
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
        self._free_handles += reversed(victims)
        self._mark_dirty(victims)

    def _acquire(self, pool: Pool, segs: list[int]) -> None:
        """Execute a plan: evacuate each victim pool's chosen segments, then reassign them.
        A segment with no live unit moves no data: reassigning it is host bookkeeping only."""
        seg_owner, seg_live = self.seg_owner, self.seg_live
        busy = [s for s in segs if seg_live[s]]
        if busy:
            taking = set(segs)
            for victim in self.pools:
                moving = [s for s in busy if seg_owner[s] == victim.index]
                if moving and victim is not pool:
                    self._evacuate(victim, moving, taking)
        by_owner: dict[int, list[int]] = {}
        for s in segs:
            by_owner.setdefault(seg_owner[s], []).append(s)
        for old, mine in by_owner.items():
            if old == -1:
                for s in mine:
                    self.unowned[self.seg_group[s]].remove(s)
            else:
                victim = self.pools[old]
                victim.owned.difference_update(mine)
                victim.empty.difference_update(mine)
                victim.free_units -= victim.units_per_segment * len(mine)
                self.migrations += len(mine)
        u, stride, index = pool.units_per_segment, self._max_units, pool.index
        rank, seg_free = self.seg_rank, self.seg_free
        for s in segs:
            seg_owner[s] = index
            rank[s] = self._next_rank
            self._next_rank += 1
            base = s * stride
            seg_free[s] = list(range(base + u - 1, base - 1, -1))  # unit 0 on top
            pool.push(s, self._seg_key)  # a new key: entries in the old owner's heap go stale
        pool.owned.update(segs)
        pool.empty.update(segs)
        pool.free_units += u * len(segs)

    def _evacuate(self, pool: Pool, segs: list[int], excluded: set[int]) -> None:
        """Move every live unit of ``segs`` into free units of ``pool``'s other segments
        (in the pool's fill order), one device copy for the whole batch."""
        w, stride = pool.unit_words, self._max_units
        h_slot, seg_live, seg_free = self._h_slot, self.seg_live, self.seg_free
        src = set(segs)
        moving = sorted((slot, h) for h, slot in enumerate(h_slot)
                        if slot >= 0 and slot // stride in src)
        targets = (s for s in pool.fill_order(pool.owned - excluded) if seg_free[s])
        dest, moves = next(targets), []
        for slot, h in moving:
            while not seg_free[dest]:
                dest = next(targets)
            d_slot = seg_free[dest].pop()
            if seg_live[dest] == 0:
                pool.empty.discard(dest)
            seg_live[dest] += 1
            if not seg_free[dest]:
                self._seg_key[dest] = -1  # full: its heap entry goes stale
            moves.append((slot // stride, slot % stride * w, dest, d_slot % stride * w))
            h_slot[h] = d_slot
        for s in segs:
            seg_live[s] = 0
            pool.empty.add(s)
        if self._dirty is not None:
            self._dirty += [h for _, h in moving]
        self.arena.move(moves, w)
        self.migrated_bytes += len(moves) * w * WORD_BYTES
        self.compactions += 1

    def free(self, request_id: Hashable, kind: str | None = None,
             handles: list[int] | None = None) -> None:
        """Free a request's units: all of them, those of ``kind``, or exactly ``handles``.

        Raises:
          DoubleFreeError: the request (or a handle) was already freed.
          UnknownRequestError: the request never held memory.
          UnknownHandleError / HandleKindError / ValueError: bad ``handles`` or ``kind``.
        Nothing is freed when any check fails.
        """
        held = self._requests.get(request_id)
        if held is None:
            if request_id in self._retired:
                raise DoubleFreeError(f"request_id {request_id!r} was already freed")
            raise UnknownRequestError(f"request_id {request_id!r} holds no memory")
        if kind is not None:
            self._pool_for(kind)
        h_owner = self._h_owner
        if handles is None:
            if kind is None:
                victims = held
            else:
                kid = self._kind_id[kind]
                victims = [h for h in held if h_owner[h][1] == kid]
        else:
            victims = list(handles)
            if len(set(victims)) != len(victims):
                raise ValueError(f"handles has duplicates: {victims}")
            for h in victims:
                if not self._is_handle(h):
                    raise UnknownHandleError(f"handle {h!r} is not a handle of this manager")
                own = h_owner[h]
                if own is None:
                    raise DoubleFreeError(f"handle {h!r} was already freed")
                if own[0] != request_id:
                    raise UnknownHandleError(
                        f"handle {h!r} is not held by request_id {request_id!r}")
                if kind is not None and KINDS[own[1]] != kind:
                    raise HandleKindError(
                        f"handle {h} has kind {KINDS[own[1]]!r}, not kind {kind!r}")
            victims = [int(h) for h in victims]
        if len(victims) == len(held):
            del self._requests[request_id]
            self._retired.add(request_id)
        elif victims:
            gone = set(victims)
            held[:] = [h for h in held if h not in gone]
        if victims:
            self._release(victims)
        self._device_table = None

    # -------------------------------------------------------------------------------- access

    def _is_handle(self, handle: Any) -> bool:
        return (isinstance(handle, _INTS) and not isinstance(handle, bool)
                and 0 <= handle < self._capacity and self._h_slot[handle] != -2)

    def _kind_of(self, handle: int) -> str | None:
        own = self._h_owner[handle]
        return None if own is None else KINDS[own[1]]

    def _locate(self, kind: str, handle: int, field: str | None) -> tuple[int, int, Field]:
        self._pool_for(kind)
        if not self._is_handle(handle) or self._h_owner[handle] is None:
            raise UnknownHandleError(f"handle {handle!r} is not a live handle")
        if self._kind_of(handle) != kind:
            raise HandleKindError(
                f"handle {handle} has kind {self._kind_of(handle)!r}, not kind {kind!r}")
        if field is None:
            f = self._default_field[kind]
        else:
            try:
                f = self._fields[kind][field]
            except KeyError:
                raise ValueError(f"field must be one of {sorted(self._fields[kind])} for kind "
                                 f"{kind!r}, got {field!r}") from None
        seg, unit = divmod(self._h_slot[handle], self._max_units)
        return seg, unit * self.pools[self.seg_owner[seg]].unit_words, f

    def read(self, kind: str, handle: int, field: str | None = None) -> jax.Array:
        """One field of a unit at its natural shape and dtype (first field by default:
        ``kv``, ``recurrent``, ``u``); :meth:`fields` lists them."""
        seg, word, f = self._locate(kind, handle, field)
        return self.arena.read(seg, word, f)

    def write(self, kind: str, handle: int, value: Any, field: str | None = None) -> None:
        """Store ``value`` (exactly the field's shape and dtype) into a unit, in place."""
        seg, word, f = self._locate(kind, handle, field)
        shape, dtype = tuple(np.shape(value)), np.dtype(getattr(value, "dtype", None))
        if shape != f.shape or dtype != f.dtype:
            raise ValueError(f"value must have shape {f.shape} and dtype {f.dtype} for field "
                             f"{f.name!r} of kind {kind!r}, got {shape} {dtype}")
        self.arena.write(seg, word, f, jnp.asarray(value))

    def read_raw(self, kind: str, handle: int) -> jax.Array:
        """The whole unit as ``uint32`` words (every field, padding included)."""
        seg, word, _ = self._locate(kind, handle, None)
        return self.arena.read_words(seg, word, self._unit_words[kind])

    def fields(self, kind: str) -> tuple[Field, ...]:
        """The typed fields of one unit of ``kind`` (names, shapes, dtypes, word offsets)."""
        self._pool_for(kind)
        return self.layout.fields(kind)

    @property
    def _table(self) -> np.ndarray:
        """The host translation table ``[H, 2]`` int32, brought up to date in one batch."""
        dirty = self._dirty
        if dirty is None:  # too many changes since the last time: rebuild it whole
            hs = range(self._capacity)
        elif dirty:
            hs = sorted(set(dirty))
        else:
            return self._table_np
        self._dirty = []
        stride, owner, pools = self._max_units, self.seg_owner, self.pools
        rows: list[int] = []
        for h in hs:
            slot = self._h_slot[h]
            if slot < 0:
                rows += (-1, -1)
            else:
                seg = slot // stride
                rows += (seg, slot % stride * pools[owner[seg]].unit_words)
        self._table_np[list(hs)] = np.asarray(rows, np.int32).reshape(-1, 2)
        return self._table_np

    def device_table(self) -> jax.Array:
        """``[H, 2]`` int32 ``(segment, word)`` per handle (-1 when free), on the arena's device.

        Uploaded once per change of the layout, not per allocation; the host table is
        brought up to date then, in one batch."""
        if self._device_table is None:
            self._device_table = jax.device_put(self._table, self.arena.buffer.device)
        return self._device_table

    @property
    def tokens_per_page(self) -> int:
        """Tokens one ``kv`` handle holds (larger than the layout's under ``unified_padded``)."""
        return self.layout.page_size

    def handles(self, request_id: Hashable) -> list[int]:
        """Live handles of a request (empty if none), in allocation order."""
        return list(self._requests.get(request_id, ()))

    def live(self) -> Iterator[tuple[int, str, Hashable, int, int, int]]:
        """Every live handle as ``(handle, kind, request, segment, word, words)``, by handle."""
        stride = self._max_units
        for h, own in enumerate(self._h_owner):
            if own is not None:
                seg, unit = divmod(self._h_slot[h], stride)
                w = self.pools[self.seg_owner[seg]].unit_words
                yield h, KINDS[own[1]], own[0], seg, unit * w, w

    def stats(self) -> dict[str, Any]:
        """Counters. ``free_bytes + used_bytes == arena_bytes``; ``used_bytes`` counts whole
        units as stored, ``padding_bytes`` the part of them that is padding."""
        arena = self.arena.nbytes
        used = sum(p.live * p.unit_words for p in self.pools) * WORD_BYTES
        live = dict(zip(KINDS, self._live_count, strict=True))
        padding = sum(
            n * (self._pool_for(k).unit_words - self.layout.unit_words(k)) * WORD_BYTES
            for k, n in live.items())
        seg_bytes = self.arena.segment_words * WORD_BYTES
        tail = sum(len(p.owned) * (self.arena.segment_words - p.units_per_segment * p.unit_words)
                   for p in self.pools) * WORD_BYTES
        return {
            "policy": self.policy.name,
            "arena_bytes": arena,
            "budget_bytes": self.budget_bytes,
            "unused_budget_bytes": self.budget_bytes - arena,
            "segment_bytes": seg_bytes,
            "num_segments": self.num_segments,
            "used_bytes": used,
            "free_bytes": arena - used,
            "padding_bytes": padding,
            "segment_tail_bytes": tail,
            "kv_pages": live["kv"],
            "state_slots": live["state"],
            "snapshot_slots": live["snapshot"],
            "stash_units": live["stash"],
            "tokens_per_page": self.tokens_per_page,
            "migrations": self.migrations,
            "migrated_bytes": self.migrated_bytes,
            "compactions": self.compactions,
            "unowned_segments": sum(len(u) for u in self.unowned),
            "pools": {p.name: {"unit_bytes": p.unit_words * WORD_BYTES,
                               "segments": len(p.owned), "live_units": p.live,
                               "free_units": p.free_units} for p in self.pools},
            "requests": len(self._requests),
        }

    def __repr__(self) -> str:
        return (f"MemoryManager(policy={self.policy.name!r}, arena={self.arena.nbytes} B, "
                f"segments={self.num_segments}x{self.arena.segment_words * WORD_BYTES} B)")
