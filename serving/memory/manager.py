"""The memory manager: virtual handles over one device arena (DESIGN.md section 6).

Requests hold stable integer handles. A handle maps to a physical ``(segment, word)`` through
a translation table kept on the host (authoritative, updated per allocation) and mirrored to
the device on demand (:meth:`MemoryManager.device_table`) for kernels to read through.

Allocation path (host only, no device work): take free units of the kind's pool; if there are
too few, ask the policy for a plan of whole segments to acquire, move the live units out of
those segments on device (one jitted, donated copy per victim pool), update the table, and
reassign the segments. Migration therefore happens only when an allocation would fail, and the
same sequence of calls always produces the same layout (no clocks, no hashing of ids: heaps
and sorted scans order every choice).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
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
MIN_AUTO_SEGMENTS = 16  # small budgets get smaller segments, so pools can still trade


def _budget_from_fraction(fraction: float, device: jax.Device) -> int:
    stats = device.memory_stats()
    if not stats or "bytes_limit" not in stats:
        raise ValueError(
            f"budget_bytes={fraction} is a fraction of free device memory, but {device} does "
            "not report memory_stats(); pass a byte count")
    return int(fraction * (stats["bytes_limit"] - stats.get("bytes_in_use", 0)))


def _default_segment_words(units: list[int], budget_words: int) -> int:
    """Segment size (words) for pools of unit sizes ``units`` in an arena of ``budget_words``.

    Aim: about ``min(2 MiB, budget / 16)`` per segment, never less than the largest unit. A
    segment that is a multiple of the largest unit only can leave most of a smaller unit's
    segment unused (e.g. one 28 KB stash in a 54 KB segment), so every multiple of any unit
    size from the aim up to twice it is a candidate, and the one whose worst pool could use
    the largest share of the whole budget wins (ties: the smaller segment). The choice
    depends only on the sizes, so it is deterministic.
    """
    biggest = max(units)
    target = min(DEFAULT_SEGMENT_BYTES, budget_words * WORD_BYTES // MIN_AUTO_SEGMENTS)
    lo = biggest * max(1, -(-target // (biggest * WORD_BYTES)))  # the former default
    hi = max(lo, min(2 * target // WORD_BYTES, budget_words))
    candidates = {lo}
    for u in set(units):
        candidates.update(range(-(-lo // u) * u, hi + 1, u))

    def worst_share(seg: int) -> float:
        n = budget_words // seg
        return min(n * (seg // u) * u for u in units) / budget_words

    return max(sorted(candidates), key=worst_share)


class MemoryManager:
    """Asymmetric paged memory for hybrid caches.

    Args:
      layout: unit geometry (:func:`serving.memory.layout_for`).
      budget_bytes: arena size in bytes (int), or a fraction in (0, 1] of free device memory.
        The arena is the largest whole number of segments that fits; the rest is unused
        (``stats()["unused_budget_bytes"]``).
      policy: ``"avmp"`` | ``"unified_padded"`` | ``"static_dual"`` | ``"multi_ended"``.
      segment_bytes: segment size. Default: about min(2 MiB, budget / 16), at least the
        largest unit, chosen among multiples of the unit sizes so that no pool loses much of
        a segment to its tail (:func:`_default_segment_words`).
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
        self._pool_of_kind = self.policy.pool_of_kind()
        self._fields = {k: {f.name: f for f in self.layout.fields(k)} for k in KINDS}
        self._default_field = {k: self.layout.fields(k)[0] for k in KINDS}

        names = list(dict.fromkeys(self._pool_of_kind.values()))
        unit_words = {n: max(self.layout.unit_words(k) for k in KINDS
                             if self._pool_of_kind[k] == n) for n in names}
        biggest = max(unit_words.values())
        if segment_bytes is None:
            seg_words = _default_segment_words(list(unit_words.values()),
                                               self.budget_bytes // WORD_BYTES)
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
        self.pools = [Pool(i, n, unit_words[n], seg_words // unit_words[n], pool_groups[i])
                      for i, n in enumerate(names)]
        self._pool_by_name = {p.name: p for p in self.pools}
        self.num_segments = num_segments
        self.arena = Arena(num_segments, seg_words, device=device)

        # Per segment: owning pool (-1: unowned), free unit indices, handle per unit, live units.
        self.seg_owner = [-1] * num_segments
        self.seg_free: list[list[int]] = [[] for _ in range(num_segments)]
        self.seg_units: list[list[int]] = [[] for _ in range(num_segments)]
        self.seg_live = [0] * num_segments
        self.seg_group = seg_groups
        self.unowned = [[s for s in range(num_segments) if seg_groups[s] == g]
                        for g in range(max(seg_groups) + 1)]
        self._group_size = [len(u) for u in self.unowned]

        # Per handle: segment, unit index, kind (None: free), request.
        self._capacity = num_segments * max(p.units_per_segment for p in self.pools)
        self._table = np.full((self._capacity, 2), -1, np.int32)
        self._device_table: jax.Array | None = None
        self._h_seg: list[int] = []
        self._h_unit: list[int] = []
        self._h_kind: list[str | None] = []
        self._h_req: list[Hashable] = []
        self._free_handles: list[int] = []
        self._requests: dict[Hashable, dict[int, None]] = {}
        self._retired: set[Hashable] = set()
        self._live_by_kind = dict.fromkeys(KINDS, 0)
        self.migrations = 0
        self.migrated_bytes = 0
        self.compactions = 0

    # ----------------------------------------------------------------------------- allocation

    def _pool_for(self, kind: str) -> Pool:
        try:
            return self._pool_by_name[self._pool_of_kind[kind]]
        except (KeyError, TypeError):
            raise UnknownKindError(f"kind must be one of {KINDS}, got {kind!r}") from None

    def capacity(self, kind: str) -> int:
        """Most units of ``kind`` this policy could ever hold at once (everything else empty)."""
        pool = self._pool_for(kind)
        return self._group_size[pool.group] * pool.units_per_segment

    def fits(self, kind: str, n: int = 1) -> bool:
        """Whether ``alloc(_, kind, n)`` would succeed now (a dry run: nothing changes)."""
        pool = self._pool_for(kind)
        if not isinstance(n, int | np.integer) or isinstance(n, bool) or n < 1:
            raise ValueError(f"n must be a positive int, got {n!r}")
        if pool.free_units >= n:
            return True
        if n > self.capacity(kind):
            return False
        need = -(-(n - pool.free_units) // pool.units_per_segment)
        return self.policy.plan(self, pool, need) is not None

    def alloc(self, request_id: Hashable, kind: str, n: int = 1) -> list[int]:
        """Allocate ``n`` units of ``kind`` for ``request_id``; return their handles.

        Raises:
          OutOfMemoryError: they do not fit now, even after migration (nothing changed).
          AllocationTooLargeError: they could not fit even in an empty arena.
          UnknownKindError / ValueError: bad ``kind`` or ``n``.
        """
        pool = self._pool_for(kind)
        if not isinstance(n, int | np.integer) or isinstance(n, bool) or n < 1:
            raise ValueError(f"n must be a positive int, got {n!r}")
        if pool.free_units < n:
            if n > self.capacity(kind):
                raise AllocationTooLargeError(
                    f"n={n} units of kind {kind!r} exceed the arena's capacity under policy "
                    f"{self.policy.name!r} ({self.capacity(kind)} units)")
            need = -(-(n - pool.free_units) // pool.units_per_segment)
            plan = self.policy.plan(self, pool, need)
            if plan is None:
                raise OutOfMemoryError(
                    f"cannot allocate n={n} units of kind {kind!r} for request {request_id!r}: "
                    f"{pool.free_units} free in its pool and no {need} segment(s) to migrate")
            self._acquire(pool, plan)
        try:
            held = self._requests[request_id]
        except KeyError:
            held = self._requests[request_id] = {}
            self._retired.discard(request_id)
        out = self._take_units(pool, kind, request_id, n)
        held.update(dict.fromkeys(out))
        self._live_by_kind[kind] += n
        self._device_table = None
        return out

    def _take_units(self, pool: Pool, kind: str, request_id: Hashable, n: int) -> list[int]:
        """Take ``n`` free units of ``pool`` (the caller made sure they exist), lowest
        segment first, a whole segment's worth at a time."""
        out: list[int] = []
        h_seg, h_unit, h_kind, h_req = self._h_seg, self._h_unit, self._h_kind, self._h_req
        free_handles, table, w = self._free_handles, self._table, pool.unit_words
        while len(out) < n:
            seg = pool.segment_with_free(self.seg_owner, self.seg_free)
            free, units = self.seg_free[seg], self.seg_units[seg]
            k = min(n - len(out), len(free))
            if self.seg_live[seg] == 0:
                pool.empty.discard(seg)
            self.seg_live[seg] += k
            for _ in range(k):
                unit = free.pop()
                if free_handles:
                    h = free_handles.pop()
                    h_seg[h], h_unit[h], h_kind[h], h_req[h] = seg, unit, kind, request_id
                else:
                    h = len(h_seg)
                    h_seg.append(seg)
                    h_unit.append(unit)
                    h_kind.append(kind)
                    h_req.append(request_id)
                units[unit] = h
                out.append(h)
            if k == 1:
                table[h, 0], table[h, 1] = seg, unit * w
            else:
                chunk = out[len(out) - k:]
                table[chunk, 0] = seg
                table[chunk, 1] = [h_unit[c] * w for c in chunk]
            pool.pop_if_full(seg, self.seg_free)
        pool.live += n
        pool.free_units -= n
        return out

    def _release(self, h: int) -> None:
        seg, unit = self._h_seg[h], self._h_unit[h]
        pool = self.pools[self.seg_owner[seg]]
        free = self.seg_free[seg]
        free.append(unit)
        if len(free) == 1:
            pool.push(seg)
        self.seg_units[seg][unit] = -1
        self.seg_live[seg] -= 1
        if self.seg_live[seg] == 0:
            pool.empty.add(seg)
        pool.live -= 1
        pool.free_units += 1
        self._live_by_kind[self._h_kind[h]] -= 1
        self._h_kind[h] = None
        self._h_req[h] = None
        self._table[h] = -1
        self._free_handles.append(h)

    def _acquire(self, pool: Pool, segs: list[int]) -> None:
        """Execute a plan: evacuate each victim pool's chosen segments, then reassign them."""
        taking = set(segs)
        for victim in self.pools:
            if victim is pool:
                continue
            moving = [s for s in segs if self.seg_owner[s] == victim.index and self.seg_live[s]]
            if moving:
                self._evacuate(victim, moving, taking)
        for s in segs:
            old = self.seg_owner[s]
            if old == -1:
                self.unowned[self.seg_group[s]].remove(s)
            else:
                victim = self.pools[old]
                victim.owned.discard(s)
                victim.empty.discard(s)
                victim.free_units -= victim.units_per_segment
                self.migrations += 1
            u = pool.units_per_segment
            self.seg_owner[s] = pool.index
            self.seg_free[s] = list(range(u - 1, -1, -1))
            self.seg_units[s] = [-1] * u
            pool.owned.add(s)
            pool.empty.add(s)
            pool.free_units += u
            pool.push(s)

    def _evacuate(self, pool: Pool, segs: list[int], excluded: set[int]) -> None:
        """Move every live unit of ``segs`` into free units of ``pool``'s other segments."""
        targets = (s for s in sorted(pool.owned - excluded) if self.seg_free[s])
        dest, moves = next(targets), []
        w = pool.unit_words
        for src in segs:
            for unit, h in enumerate(self.seg_units[src]):
                if h < 0:
                    continue
                while not self.seg_free[dest]:
                    dest = next(targets)
                d_unit = self.seg_free[dest].pop()
                if self.seg_live[dest] == 0:
                    pool.empty.discard(dest)
                moves.append((src, unit * w, dest, d_unit * w))
                self.seg_units[dest][d_unit] = h
                self.seg_live[dest] += 1
                self.seg_units[src][unit] = -1
                self.seg_free[src].append(unit)
                self.seg_live[src] -= 1
                self._h_seg[h], self._h_unit[h] = dest, d_unit
                self._table[h] = (dest, d_unit * w)
            pool.empty.add(src)
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
        if handles is None:
            victims = [h for h in held if kind is None or self._h_kind[h] == kind]
        else:
            victims = list(handles)
            if len(set(victims)) != len(victims):
                raise ValueError(f"handles has duplicates: {victims}")
            for h in victims:
                if not self._is_handle(h):
                    raise UnknownHandleError(f"handle {h!r} is not a handle of this manager")
                if h not in held:
                    if self._h_kind[h] is None:
                        raise DoubleFreeError(f"handle {h!r} was already freed")
                    raise UnknownHandleError(
                        f"handle {h!r} is not held by request_id {request_id!r}")
                if kind is not None and self._h_kind[h] != kind:
                    raise HandleKindError(
                        f"handle {h} has kind {self._h_kind[h]!r}, not kind {kind!r}")
        for h in victims:
            self._release(h)
            del held[h]
        if not held:
            del self._requests[request_id]
            self._retired.add(request_id)
        self._device_table = None

    # -------------------------------------------------------------------------------- access

    def _is_handle(self, handle: Any) -> bool:
        return (isinstance(handle, int | np.integer) and not isinstance(handle, bool)
                and 0 <= handle < len(self._h_seg))

    def _locate(self, kind: str, handle: int, field: str | None) -> tuple[int, int, Field]:
        self._pool_for(kind)
        if not self._is_handle(handle) or self._h_kind[handle] is None:
            raise UnknownHandleError(f"handle {handle!r} is not a live handle")
        if self._h_kind[handle] != kind:
            raise HandleKindError(
                f"handle {handle} has kind {self._h_kind[handle]!r}, not kind {kind!r}")
        if field is None:
            f = self._default_field[kind]
        else:
            try:
                f = self._fields[kind][field]
            except KeyError:
                raise ValueError(f"field must be one of {sorted(self._fields[kind])} for kind "
                                 f"{kind!r}, got {field!r}") from None
        seg, unit = self._h_seg[handle], self._h_unit[handle]
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
        return self.arena.read_words(seg, word, self.layout.unit_words(kind))

    def fields(self, kind: str) -> tuple[Field, ...]:
        """The typed fields of one unit of ``kind`` (names, shapes, dtypes, word offsets)."""
        self._pool_for(kind)
        return self.layout.fields(kind)

    def device_table(self) -> jax.Array:
        """``[H, 2]`` int32 ``(segment, word)`` per handle (-1 when free), on the arena's device.

        Uploaded once per change of the layout, not per allocation."""
        if self._device_table is None:
            self._device_table = jax.device_put(self._table, self.arena.buffer.device)
        return self._device_table

    @property
    def tokens_per_page(self) -> int:
        """Tokens one ``kv`` handle holds (larger than the layout's under ``unified_padded``)."""
        return self.layout.page_size

    def handles(self, request_id: Hashable) -> list[int]:
        """Live handles of a request (empty if none)."""
        return list(self._requests.get(request_id, ()))

    def live(self) -> Iterator[tuple[int, str, Hashable, int, int, int]]:
        """Every live handle as ``(handle, kind, request, segment, word, words)``."""
        for h, kind in enumerate(self._h_kind):
            if kind is not None:
                seg = self._h_seg[h]
                w = self.pools[self.seg_owner[seg]].unit_words
                yield h, kind, self._h_req[h], seg, self._h_unit[h] * w, w

    def stats(self) -> dict[str, Any]:
        """Counters. ``free_bytes + used_bytes == arena_bytes``; ``used_bytes`` counts whole
        units as stored, ``padding_bytes`` the part of them that is padding."""
        arena = self.arena.nbytes
        used = sum(p.live * p.unit_words for p in self.pools) * WORD_BYTES
        padding = sum(
            n * (self._pool_for(k).unit_words - self.layout.unit_words(k)) * WORD_BYTES
            for k, n in self._live_by_kind.items())
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
            "kv_pages": self._live_by_kind["kv"],
            "state_slots": self._live_by_kind["state"],
            "snapshot_slots": self._live_by_kind["snapshot"],
            "stash_units": self._live_by_kind["stash"],
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
