"""The virtual handle space: stable integer handles over the units of the arena.

Requests hold handles. A handle maps to a slot (``segment * max_units + unit``, segments.py)
in host bookkeeping, which is authoritative; when a unit moves (migration.py) only its slot
changes, never its handle. The ``[H, 2]`` int32 translation table ``(segment, word)`` that
kernels read through is derived from it: a host numpy copy, brought up to date in one batch,
from the handles changed since it was last read, only when it is read; and a device copy,
uploaded once per change of the layout.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import jax
import numpy as np

from serving.memory.errors import (
    DoubleFreeError,
    HandleKindError,
    UnknownHandleError,
    UnknownRequestError,
)
from serving.memory.layout import KINDS
from serving.memory.segments import SegmentMap


def _copy_into(old: jax.Array, new: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_slice(old, new, (0, 0))


_refresh = jax.jit(_copy_into, donate_argnums=0)  # ``new``'s values in ``old``'s buffer

KIND_ID = {k: i for i, k in enumerate(KINDS)}  # owners store a kind as its index in KINDS
_INTS = (int, np.integer)  # a tuple: ``int | np.integer`` would build a union on every call


class HandleTable:
    """Which unit each handle names and who holds it.

    Per handle: its slot (-1: freed, -2: never issued) and its owner ``(request, kind id)``
    (None: not live). Free handles form a stack: never-used ones come out lowest first, a freed
    one is the next given out. Per request: its live handles in allocation order; requests that
    freed all theirs are remembered (a second free is a double free). Per kind: the live units.
    ``dirty`` lists the handles changed since the host table was last brought up to date
    (``None``: more than twice the capacity, so it is rebuilt whole).
    """

    def __init__(self, segments: SegmentMap):
        self._segments = segments
        capacity = self.capacity = segments.num_segments * segments.max_units
        self.slot = [-2] * capacity
        self.owner: list[tuple[Hashable, int] | None] = [None] * capacity
        self.free = list(range(capacity - 1, -1, -1))
        self.requests: dict[Hashable, list[int]] = {}
        self.retired: set[Hashable] = set()
        self.live_count = [0] * len(KINDS)
        self.dirty: list[int] | None = []
        self._host = np.full((capacity, 2), -1, np.int32)
        self._device: jax.Array | None = None
        self._resident: jax.Array | None = None  # the device buffer the table lives in

    # --------------------------------------------------------------------- issue and release

    def issue(self, request_id: Hashable, kind_id: int, slots: list[int]) -> list[int]:
        """New handles of ``request_id`` for the units at ``slots`` (of kind ``kind_id``), in
        that order."""
        n = len(slots)
        owner = (request_id, kind_id)
        if n == 1:
            h = self.free.pop()
            self.slot[h] = slots[0]
            self.owner[h] = owner
            out = [h]
        else:
            free = self.free
            out = free[-n:]
            del free[-n:]
            out.reverse()  # never-used handles come out lowest first
            h_slot, h_owner = self.slot, self.owner
            for h, slot in zip(out, slots, strict=True):
                h_slot[h] = slot
                h_owner[h] = owner
        self.mark_dirty(out)
        held = self.requests.get(request_id)
        if held is None:
            self.requests[request_id] = out.copy()
            self.retired.discard(request_id)
        else:
            held += out
        self.live_count[kind_id] += n
        self._device = None
        return out

    def held(self, request_id: Hashable) -> list[int]:
        """The live handles of ``request_id`` (the table's own list).

        Raises:
          DoubleFreeError: the request freed all its handles already.
          UnknownRequestError: it never held any.
        """
        held = self.requests.get(request_id)
        if held is None:
            if request_id in self.retired:
                raise DoubleFreeError(f"request_id {request_id!r} was already freed")
            raise UnknownRequestError(f"request_id {request_id!r} holds no memory")
        return held

    def release(self, request_id: Hashable, kind: str | None, handles: Any) -> list[int]:
        """Free the handles of ``request_id`` (all, those of ``kind``, or exactly ``handles``);
        return the slots of their units.

        Raises (before anything changes):
          DoubleFreeError / UnknownRequestError: as :meth:`held`, or a handle already freed.
          UnknownHandleError: a handle not of this table, or not held by the request.
          HandleKindError: a handle of another kind than ``kind``.
          ValueError: ``handles`` has duplicates.
        """
        held = self.held(request_id)
        h_owner = self.owner
        if handles is None:
            if kind is None:
                victims = held
            else:
                kid = KIND_ID[kind]
                victims = [h for h in held if h_owner[h][1] == kid]
        else:
            victims = list(handles)
            if len(set(victims)) != len(victims):
                raise ValueError(f"handles has duplicates: {victims}")
            for h in victims:
                if not self.is_handle(h):
                    raise UnknownHandleError(f"handle {h!r} is not a handle of this manager")
                own = h_owner[h]
                if own is None:
                    raise DoubleFreeError(f"handle {h!r} was already freed")
                if own[0] != request_id:
                    raise UnknownHandleError(
                        f"handle {h!r} is not held by request_id {request_id!r}"
                    )
                if kind is not None and KINDS[own[1]] != kind:
                    raise HandleKindError(
                        f"handle {h} has kind {KINDS[own[1]]!r}, not kind {kind!r}"
                    )
            victims = [int(h) for h in victims]
        if len(victims) == len(held):
            del self.requests[request_id]
            self.retired.add(request_id)
        elif victims:
            gone = set(victims)
            held[:] = [h for h in held if h not in gone]
        h_slot, live_count = self.slot, self.live_count
        slots = [h_slot[h] for h in victims]
        for h in victims:
            h_slot[h] = -1
            live_count[h_owner[h][1]] -= 1
            h_owner[h] = None
        if victims:
            self.free += reversed(victims)  # the last one freed is the next one given out
            self.mark_dirty(victims)
        self._device = None
        return slots

    def relocate(self, segs: list[int], dests: list[int]) -> list[int]:
        """Point the live handles of segments ``segs``, in slot order, at ``dests``; return
        their old slots, in that order."""
        stride, h_slot, src = self._segments.max_units, self.slot, set(segs)
        moving = sorted(
            (slot, h) for h, slot in enumerate(h_slot) if slot >= 0 and slot // stride in src
        )
        for (_, h), dest in zip(moving, dests, strict=True):
            h_slot[h] = dest
        if self.dirty is not None:
            self.dirty += [h for _, h in moving]
        return [slot for slot, _ in moving]

    def mark_dirty(self, handles: list[int]) -> None:
        """Queue ``handles`` for the next table update (a full rebuild once the queue outgrows
        twice the capacity)."""
        dirty = self.dirty
        if dirty is not None:
            dirty += handles
            if len(dirty) > 2 * self.capacity:
                self.dirty = None

    # ---------------------------------------------------------------------------- lookups

    def is_handle(self, handle: Any) -> bool:
        """Whether ``handle`` was ever issued by this table (live or freed)."""
        return (
            isinstance(handle, _INTS)
            and not isinstance(handle, bool)
            and 0 <= handle < self.capacity
            and self.slot[handle] != -2
        )

    def kind_of(self, handle: int) -> str | None:
        """The kind of a live handle (None when freed)."""
        own = self.owner[handle]
        return None if own is None else KINDS[own[1]]

    def host_table(self) -> np.ndarray:
        """The host translation table ``[H, 2]`` int32 ``(segment, word)`` (-1 when free),
        brought up to date in one batch."""
        dirty = self.dirty
        if dirty is None:  # too many changes since the last time: rebuild it whole
            hs = range(self.capacity)
        elif dirty:
            hs = sorted(set(dirty))
        else:
            return self._host
        self.dirty = []
        sm = self._segments
        stride, owner, pools = sm.max_units, sm.seg_owner, sm.pools
        rows: list[int] = []
        for h in hs:
            slot = self.slot[h]
            if slot < 0:
                rows += (-1, -1)
            else:
                seg = slot // stride
                rows += (seg, slot % stride * pools[owner[seg]].unit_words)
        self._host[list(hs)] = np.asarray(rows, np.int32).reshape(-1, 2)
        return self._host

    def device_table(self, device: jax.Device) -> jax.Array:
        """The translation table on ``device``, uploaded again only after a change, into the
        same device buffer: a program that runs as a CUDA graph re-records every command
        whose buffers moved since its last call, and every arena kernel reads the table, so
        a table at a new address each step would re-record most of the step's graph."""
        if self._device is None:
            host = self.host_table()
            old = self._resident
            # copied, never aliased: on CPU a device_put of a large numpy array may share its
            # memory, and the host table changes in place while programs may still read it
            new = jax.device_put(host, device, may_alias=False)
            self._resident = _refresh(old, new) if self._in_place(device) else new
            self._device = self._resident
        return self._device

    def _in_place(self, device) -> bool:
        """Whether the resident device table can be updated in place on ``device``."""
        old = self._resident
        return (
            old is not None
            and old.shape == self._host.shape
            and not old.is_deleted()
            and old.devices() == {device}
        )

    def device_delta(self, device: jax.Device, rows: int) -> tuple[jax.Array, np.ndarray]:
        """The device table and its changes since the last upload: ``(table, delta int32
        [rows, 3])``, one ``(handle, segment, word)`` row per changed handle, padded with
        handle ``capacity`` (out of range: dropped). A step program given both applies the
        delta to the table (donated, so in place) and returns it, and the caller hands the
        result back with :meth:`adopt`: the changes reach the device with the step's other
        inputs instead of in an upload and a program of their own (a speculative step changes
        the layout in most steps).
        With more than ``rows`` changes, or no table on ``device`` to update, the table is
        uploaded whole (:meth:`device_table`) and the delta is empty."""
        delta = np.zeros((rows, 3), np.int32)
        delta[:, 0] = self.capacity
        if self._device is not None:
            return self._device, delta
        dirty = self.dirty
        if dirty is None or len(set(dirty)) > rows or not self._in_place(device):
            return self.device_table(device), delta
        hs = sorted(set(dirty))
        host = self.host_table()
        delta[: len(hs), 0] = hs
        delta[: len(hs), 1:] = host[hs]
        old, self._resident = self._resident, None  # donated to the step: adopt() follows
        return old, delta

    def adopt(self, table: jax.Array) -> None:
        """Take ``table`` (returned by a step that applied :meth:`device_delta`'s delta) as the
        up-to-date device table."""
        self._resident = self._device = table
