"""The memory manager: virtual handles over one device arena (docs/design.md).

:class:`MemoryManager` is the public face of the package. It sizes the arena and its segments,
checks every argument, and composes four pieces, each with one job:

- :class:`~serving.memory.segments.SegmentMap` (segments.py): owner, live units, rank and free
  slots of every segment, the pools, the unowned segments;
- :class:`~serving.memory.handles.HandleTable` (handles.py): the stable handles requests hold,
  their slots and owners, and the ``[H, 2]`` translation table kernels read through;
- :class:`~serving.memory.allocator.Allocator` (allocator.py): takes and returns units, asks the
  policy for whole segments when a pool runs short, and answers ``fits`` / ``fits_all`` with
  the same code;
- :class:`~serving.memory.migration.Migrator` (migration.py): hands segments over between pools,
  moving live units out of them on device.

Allocation path (host only, no device work unless units must move): take free units of the
kind's pool; if there are too few, ask the policy for a plan of whole segments to acquire, move
the live units out of those segments on device (one jitted, donated copy per victim pool),
update the handles, and reassign the segments. Re-assigning a wholly free segment is host
bookkeeping only. Migration therefore happens only when an allocation would fail, and the same
sequence of calls always produces the same layout (no clocks, no hashing of ids: heaps and
ordered scans make every choice).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
from jax import numpy as jnp

from serving.memory.allocator import Allocator
from serving.memory.arena import Arena, free_bytes
from serving.memory.errors import (
    AllocationTooLargeError,
    HandleKindError,
    OutOfMemoryError,
    UnknownHandleError,
    UnknownKindError,
)
from serving.memory.handles import KIND_ID, HandleTable
from serving.memory.layout import KINDS, WORD_BYTES, Field, HybridLayout
from serving.memory.migration import Migrator
from serving.memory.policies import Policy, make_policy
from serving.memory.pools import Pool
from serving.memory.segments import SegmentMap

DEFAULT_SEGMENT_BYTES = 2 << 20
# Small budgets get smaller segments, so pools can still trade: a pool wastes at most one
# partly filled segment, i.e. about 1/MIN_AUTO_SEGMENTS of the arena (never below one unit).
MIN_AUTO_SEGMENTS = 32
# A default segment may make a unit cost this much more than unified_padded's page does.
SEGMENT_COST_SLACK = 0.01
_INTS = (int, np.integer)  # a tuple: ``int | np.integer`` would build a union on every call


def _budget_from_fraction(fraction: float, device: jax.Device) -> int:
    free = free_bytes(device)
    if free is None:
        raise ValueError(
            f"budget_bytes={fraction} is a fraction of free device memory, but {device} does "
            "not report memory_stats(); pass a byte count"
        )
    return int(fraction * free)


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

    Deliberately not a criterion: the share of a segment the worst pool can fill. It would pick
    60 KiB segments for the tiny model (2 stashes exactly, but a state slot 87.5% full against
    the padded page's 93.75%), with which AVMP loses 18 tiny cells of the memory study to
    ``unified_padded``, mostly snapshot cells, whose memory is state slots
    (benchmarks/README.md). A budget below one padded page gets one segment of the largest unit.
    Deterministic.
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
      unit_align_words: every pool's unit size (so every unit's place) and the segment size
        are rounded up to a multiple of this many words: 128 for the TPU arena kernels, which
        move a state as whole 128-word lane rows (:mod:`pallas_kernels.tpu._arena`); 1 packs
        units at their natural sizes.
      **policy_args: e.g. ``ratio=0.9`` for ``static_dual``.

    ``pools``, ``seg_owner``, ``seg_live``, ``seg_rank``, ``seg_free``, ``seg_group`` and
    ``unowned`` are the segment map's own containers (read them, do not change them);
    ``migrations``, ``migrated_bytes`` and ``compactions`` the migrator's counters.
    """

    def __init__(
        self,
        layout: HybridLayout,
        budget_bytes: int | float,
        policy: str = "avmp",
        *,
        segment_bytes: int | None = None,
        device: jax.Device | None = None,
        unit_align_words: int = 1,
        **policy_args: Any,
    ):
        if not isinstance(layout, HybridLayout):
            raise ValueError(f"layout must be a HybridLayout, got {type(layout).__name__}")
        if not isinstance(unit_align_words, int | np.integer) or unit_align_words < 1:
            raise ValueError(f"unit_align_words must be a positive int, got {unit_align_words!r}")
        self.unit_align_words = int(unit_align_words)
        align = self.unit_align_words
        device = device or jax.devices()[0]
        if isinstance(budget_bytes, float):
            if not 0 < budget_bytes <= 1:
                raise ValueError(
                    f"budget_bytes as a fraction must be in (0, 1], got {budget_bytes}"
                )
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
        unit_words = {
            n: -(-max(self.layout.unit_words(k) for k in KINDS if self._pool_of_kind[k] == n)
                // align) * align
            for n in names
        }  # fmt: skip
        biggest = max(unit_words.values())
        if segment_bytes is None:
            seg_words = _default_segment_words(unit_words, self.budget_bytes // WORD_BYTES)
        else:
            if segment_bytes % (WORD_BYTES * align) or segment_bytes < biggest * WORD_BYTES:
                raise ValueError(
                    f"segment_bytes must be a multiple of {WORD_BYTES * align} and >= the "
                    f"largest unit ({biggest * WORD_BYTES} bytes), got {segment_bytes}"
                )
            seg_words = segment_bytes // WORD_BYTES
        num_segments = self.budget_bytes // (seg_words * WORD_BYTES)
        if num_segments < 1:
            raise ValueError(
                f"budget_bytes={self.budget_bytes} is smaller than one segment "
                f"({seg_words * WORD_BYTES} bytes)"
            )
        pool_groups, seg_groups = self.policy.pool_groups(names, num_segments)
        segments = SegmentMap(
            [(n, unit_words[n], pool_groups[i]) for i, n in enumerate(names)],
            seg_words,
            seg_groups,
        )
        self.num_segments = num_segments
        self.arena = Arena(num_segments, seg_words, device=device)
        self._segments = segments
        self._handles = HandleTable(segments)
        self._migrator = Migrator(segments, self._handles, self.arena)
        self._allocator = Allocator(segments, self.policy, self._migrator)
        pool_by_name = {p.name: p for p in segments.pools}
        self._kind_pool = {k: pool_by_name[self._pool_of_kind[k]] for k in KINDS}
        self._kind_id = KIND_ID

    # ------------------------------------------------------------------- the pieces' state

    @property
    def pools(self) -> list[Pool]:
        return self._segments.pools

    @property
    def seg_owner(self) -> list[int]:
        return self._segments.seg_owner

    @property
    def seg_live(self) -> list[int]:
        return self._segments.seg_live

    @property
    def seg_rank(self) -> list[int]:
        return self._segments.seg_rank

    @property
    def seg_free(self) -> list[list[int]]:
        return self._segments.seg_free

    @property
    def seg_group(self) -> list[int]:
        return self._segments.seg_group

    @property
    def unowned(self) -> list[list[int]]:
        return self._segments.unowned

    @property
    def migrations(self) -> int:
        """Segments taken from another pool so far."""
        return self._migrator.migrations

    @property
    def migrated_bytes(self) -> int:
        """Bytes of live units moved on device so far."""
        return self._migrator.migrated_bytes

    @property
    def compactions(self) -> int:
        """Device copy calls that moved live units so far (one per victim pool and plan)."""
        return self._migrator.compactions

    # Host state by the names the tests and benchmarks/alloc_replay.py read.

    @property
    def _table(self) -> np.ndarray:
        """The host translation table ``[H, 2]`` int32, brought up to date in one batch."""
        return self._handles.host_table()

    @property
    def _dirty(self) -> list[int] | None:
        return self._handles.dirty

    @property
    def _h_slot(self) -> list[int]:
        return self._handles.slot

    @property
    def _h_owner(self) -> list[tuple[Hashable, int] | None]:
        return self._handles.owner

    @property
    def _free_handles(self) -> list[int]:
        return self._handles.free

    @property
    def _max_units(self) -> int:
        return self._segments.max_units

    # ----------------------------------------------------------------------------- allocation

    def _pool_for(self, kind: str) -> Pool:
        try:
            return self._kind_pool[kind]
        except (KeyError, TypeError):
            raise UnknownKindError(f"kind must be one of {KINDS}, got {kind!r}") from None

    def capacity(self, kind: str) -> int:
        """Most units of ``kind`` this policy could ever hold at once (everything else empty)."""
        return self._allocator.capacity(self._pool_for(kind))

    def fits(self, kind: str, n: int = 1) -> bool:
        """Whether ``alloc(_, kind, n)`` would succeed now (a dry run: nothing changes)."""
        pool = self._pool_for(kind)
        if not isinstance(n, _INTS) or isinstance(n, bool) or n < 1:
            raise ValueError(f"n must be a positive int, got {n!r}")
        return self._allocator.fits(pool, int(n))

    def fits_all(self, needs: Mapping[str, int] | Iterable[tuple[str, int]]) -> bool:
        """Whether allocating every ``(kind, n)`` of ``needs``, in order, would succeed now.

        A dry run of the whole sequence (nothing changes): unlike separate :meth:`fits` calls,
        it never counts one free segment for two kinds. ``n == 0`` entries are skipped.
        """
        items = list(needs.items() if isinstance(needs, Mapping) else needs)
        pooled = []
        for kind, n in items:
            pool = self._pool_for(kind)
            if not isinstance(n, _INTS) or isinstance(n, bool) or n < 0:
                raise ValueError(f"n must be a non-negative int, got {n!r} for kind {kind!r}")
            pooled.append((pool, int(n)))
        return self._allocator.fits_all(pooled)

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
        slots = self._allocator.take(pool, n)
        if slots is None:
            if n > self._allocator.capacity(pool):
                raise AllocationTooLargeError(
                    f"n={n} units of kind {kind!r} exceed the arena's capacity under policy "
                    f"{self.policy.name!r} ({self.capacity(kind)} units)"
                )
            raise OutOfMemoryError(
                f"cannot allocate n={n} units of kind {kind!r} for request {request_id!r}: "
                f"{pool.free_units} free in its pool and no "
                f"{self._allocator.shortfall(pool, n)} segment(s) to migrate"
            )
        return self._handles.issue(request_id, self._kind_id[kind], slots)

    def free(
        self, request_id: Hashable, kind: str | None = None, handles: list[int] | None = None
    ) -> None:
        """Free a request's units: all of them, those of ``kind``, or exactly ``handles``.

        Raises:
          DoubleFreeError: the request (or a handle) was already freed.
          UnknownRequestError: the request never held memory.
          UnknownHandleError / HandleKindError / ValueError: bad ``handles`` or ``kind``.
        Nothing is freed when any check fails.
        """
        self._handles.held(request_id)  # the request is checked first, then the kind
        if kind is not None:
            self._pool_for(kind)
        self._allocator.give_back(self._handles.release(request_id, kind, handles))

    # -------------------------------------------------------------------------------- access

    def _locate(self, kind: str, handle: int, field: str | None) -> tuple[int, int, Field]:
        self._pool_for(kind)
        table = self._handles
        if not table.is_handle(handle) or table.owner[handle] is None:
            raise UnknownHandleError(f"handle {handle!r} is not a live handle")
        if table.kind_of(handle) != kind:
            raise HandleKindError(
                f"handle {handle} has kind {table.kind_of(handle)!r}, not kind {kind!r}"
            )
        if field is None:
            f = self._default_field[kind]
        else:
            try:
                f = self._fields[kind][field]
            except KeyError:
                raise ValueError(
                    f"field must be one of {sorted(self._fields[kind])} for kind "
                    f"{kind!r}, got {field!r}"
                ) from None
        sm = self._segments
        seg, unit = divmod(table.slot[handle], sm.max_units)
        return seg, unit * sm.pools[sm.seg_owner[seg]].unit_words, f

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
            raise ValueError(
                f"value must have shape {f.shape} and dtype {f.dtype} for field "
                f"{f.name!r} of kind {kind!r}, got {shape} {dtype}"
            )
        self.arena.write(seg, word, f, jnp.asarray(value))

    def read_raw(self, kind: str, handle: int) -> jax.Array:
        """The whole unit as ``uint32`` words (every field, padding included)."""
        seg, word, _ = self._locate(kind, handle, None)
        return self.arena.read_words(seg, word, self._unit_words[kind])

    def fields(self, kind: str) -> tuple[Field, ...]:
        """The typed fields of one unit of ``kind`` (names, shapes, dtypes, word offsets)."""
        self._pool_for(kind)
        return self.layout.fields(kind)

    def device_table(self) -> jax.Array:
        """``[H, 2]`` int32 ``(segment, word)`` per handle (-1 when free), on the arena's device.

        Uploaded once per change of the layout, not per allocation; the host table is
        brought up to date then, in one batch."""
        return self._handles.device_table(self._table_placement())

    def device_delta(self, rows: int) -> tuple[jax.Array, np.ndarray]:
        """``(device table, delta int32 [rows, 3])``: the table as last uploaded and the
        ``(handle, segment, word)`` rows changed since, for a step program to apply in place
        and return to :meth:`adopt_table` (:meth:`HandleTable.device_delta`)."""
        return self._handles.device_delta(self._table_placement(), rows)

    def adopt_table(self, table: jax.Array) -> None:
        """The device table a step returned after applying :meth:`device_delta`'s delta."""
        self._handles.adopt(table)

    def _table_placement(self):
        return self.arena.buffer.device

    @property
    def tokens_per_page(self) -> int:
        """Tokens one ``kv`` handle holds (larger than the layout's under ``unified_padded``)."""
        return self.layout.page_size

    def handles(self, request_id: Hashable) -> list[int]:
        """Live handles of a request (empty if none), in allocation order."""
        return list(self._handles.requests.get(request_id, ()))

    def live(self) -> Iterator[tuple[int, str, Hashable, int, int, int]]:
        """Every live handle as ``(handle, kind, request, segment, word, words)``, by handle."""
        sm, slot = self._segments, self._handles.slot
        stride, pools, seg_owner = sm.max_units, sm.pools, sm.seg_owner
        for h, own in enumerate(self._handles.owner):
            if own is not None:
                seg, unit = divmod(slot[h], stride)
                w = pools[seg_owner[seg]].unit_words
                yield h, KINDS[own[1]], own[0], seg, unit * w, w

    def stats(self) -> dict[str, Any]:
        """Counters. ``free_bytes + used_bytes == arena_bytes``; ``used_bytes`` counts whole
        units as stored, ``padding_bytes`` the part of them that is padding."""
        arena = self.arena.nbytes
        used = sum(p.live * p.unit_words for p in self.pools) * WORD_BYTES
        live = dict(zip(KINDS, self._handles.live_count, strict=True))
        padding = sum(
            n * (self._pool_for(k).unit_words - self.layout.unit_words(k)) * WORD_BYTES
            for k, n in live.items()
        )
        seg_bytes = self.arena.segment_words * WORD_BYTES
        tail = (
            sum(
                len(p.owned) * (self.arena.segment_words - p.units_per_segment * p.unit_words)
                for p in self.pools
            )
            * WORD_BYTES
        )
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
            "pools": {
                p.name: {
                    "unit_bytes": p.unit_words * WORD_BYTES,
                    "segments": len(p.owned),
                    "live_units": p.live,
                    "free_units": p.free_units,
                }
                for p in self.pools
            },
            "requests": len(self._handles.requests),
        }

    def __repr__(self) -> str:
        return (
            f"MemoryManager(policy={self.policy.name!r}, arena={self.arena.nbytes} B, "
            f"segments={self.num_segments}x{self.arena.segment_words * WORD_BYTES} B)"
        )
