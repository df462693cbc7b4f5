"""Requests, admission and preemption.

Memory comes from the :class:`~serving.memory.MemoryManager`: per request one ``state`` slot,
its speculative scratch (one ``stash`` unit of ``N`` nodes for tree WY, ``N`` ``snapshot``
units for the snapshot method) and one ``kv`` page per ``page_size`` tokens, grown before each
step. With the arena cache (the default) the step functions read and write the target's cache
through these handles (``Request.state_handle``, ``Request.kv_handles``), and the verify step
writes the request's draft-tree state into its scratch units (``Request.spec_handles``), which
the commit reads back (:meth:`serving.runner.ArenaRunner.verify`). Each request also
keeps a dense slot id and page ids (``slot``, ``pages``) for runners with their own pools
(``cache="pools"``: the target and a draft model); with the arena cache a draft model's cache
shares the target's units and handles.

Preemption is by recompute: the victim (the most recently admitted running request) frees
everything and goes back to the front of the queue; on readmission it prefills its prompt
plus all its output but the last token, which stays its pending token. Nothing is sampled
again, so no token is lost or duplicated.

Admission reserves a request's first prefill chunk (``admission="chunk"``, the default, as
vLLM's scheduler allocates per step) or its whole prompt (``"prompt"``): then a request once
admitted never needs pages for its own prefill, so a long prompt is not preempted part way
through it by its own growth, at the cost of holding its pages before its chunks run.

A request that can never fit (more tokens than ``pages_per_seq`` pages hold, or more memory
than the arena holds with nothing else running) is rejected at once: it is finished with
``Request.error`` set and its memory freed, and the other requests go on.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Hashable

import numpy as np

from serving.memory import MemoryManager, OutOfMemoryError
from serving.memory.errors import AllocationTooLargeError
from serving.params import SamplingParams

# What admission reserves: the first prefill chunk's pages (the rest grow step by step, and
# a request preempted mid-prefill recomputes its chunks), or the whole prompt's at once.
ADMISSIONS = ("chunk", "prompt")


class _NeverFits(Exception):
    """The request needs more than the engine could ever give it."""


@dataclasses.dataclass(eq=False)
class Request:
    index: int
    rid: Hashable
    prompt: list[int]
    params: SamplingParams
    arrival: float
    output: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0  # tokens in the cache
    slot: int | None = None
    state_handle: int | None = None
    pages: list[int] = dataclasses.field(default_factory=list)
    kv_handles: list[int] = dataclasses.field(default_factory=list)
    # speculative scratch: [stash handle] (tree WY) or N snapshot handles (node order)
    spec_handles: list[int] = dataclasses.field(default_factory=list)
    hidden: np.ndarray | None = None  # target's hidden state at the last cached token (MTP)
    finished: bool = False
    first_token_time: float | None = None
    last_token_time: float | None = None
    accept_lengths: list[int] = dataclasses.field(default_factory=list)
    preemptions: int = 0
    error: str | None = None  # why the scheduler rejected the request (it never fits)

    @property
    def prefill_tokens(self) -> list[int]:
        """What the cache must hold before decoding: the prompt, and after a preemption all
        output but the pending last token."""
        return self.prompt + self.output[:-1]

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.prefill_tokens) or not self.output

    def context(self) -> np.ndarray:
        return np.asarray(self.prompt + self.output, np.int32)


class Scheduler:
    """Waiting queue, running list, and the memory of each running request."""

    def __init__(
        self,
        manager: MemoryManager,
        *,
        num_slots: int,
        num_pages: int,
        page_size: int,
        pages_per_seq: int,
        spec_kind: str | None,
        spec_units: int,
        admission: str = "chunk",
    ):
        if admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {ADMISSIONS}, got {admission!r}")
        self.admission = admission
        self.manager = manager
        self.page_size = page_size
        self.pages_per_seq = pages_per_seq
        self.spec_kind = spec_kind
        self.spec_units = spec_units
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.free_pages = list(range(num_pages - 1, -1, -1))
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.preemptions = 0
        self.peak_spec_units = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def ensure_tokens(self, req: Request, tokens: int) -> bool:
        """Grow ``req``'s pages to hold ``tokens`` tokens; False (nothing changed) on OOM.
        Raises ``_NeverFits`` when no arena state could give them."""
        need = -(-tokens // self.page_size) - len(req.pages)
        if need <= 0:
            return True
        if len(req.pages) + need > self.pages_per_seq:
            raise _NeverFits(
                f"max_model_len: request {req.index} needs {tokens} tokens, more than the "
                f"{self.pages_per_seq * self.page_size} the engine was built for"
            )
        try:
            handles = self.manager.alloc(req.rid, "kv", need)
        except AllocationTooLargeError as e:
            raise _NeverFits(f"memory_budget: request {req.index} never fits: {e}") from None
        except OutOfMemoryError:
            return False
        req.kv_handles += handles
        req.pages += [self.free_pages.pop() for _ in range(need)]
        return True

    def _release(self, req: Request) -> None:
        if self.manager.handles(req.rid):
            self.manager.free(req.rid)
        if req.slot is not None:
            self.free_slots.append(req.slot)
        self.free_pages.extend(reversed(req.pages))
        req.slot, req.pages, req.kv_handles, req.computed, req.hidden = None, [], [], 0, None
        req.state_handle, req.spec_handles = None, []

    def admit(self, max_running: int, first_chunk: int) -> None:
        """Admit waiting requests in order while a slot, a state, the speculative scratch and
        the first chunk's pages fit (``admission="chunk"``), or the pages of the whole prompt
        (``"prompt"``). A request that does not fit with nothing else running (or could not
        fit in any arena state) is rejected and the next one is tried."""
        while self.waiting and len(self.running) < max_running and self.free_slots:
            req = self.waiting[0]
            try:
                (req.state_handle,) = self.manager.alloc(req.rid, "state", 1)
                if self.spec_kind is not None:
                    req.spec_handles = self.manager.alloc(req.rid, self.spec_kind, self.spec_units)
                first = len(req.prefill_tokens)
                if self.admission == "chunk":
                    first = min(first, first_chunk)
                fits = self.ensure_tokens(req, max(first, 1))
            except (_NeverFits, AllocationTooLargeError) as e:
                self.waiting.popleft()
                self.reject(req, str(e))
                continue
            except OutOfMemoryError:
                fits = False
            if not fits:
                self._release(req)
                if self.running:
                    return  # wait for running requests to free memory
                self.waiting.popleft()
                self.reject(
                    req,
                    f"memory_budget: request {req.index} does not fit even alone "
                    f"({self.manager.stats()['arena_bytes']} bytes arena)",
                )
                continue
            req.slot = self.free_slots.pop()
            self.waiting.popleft()
            self.running.append(req)
            self.peak_spec_units = max(self.peak_spec_units, self._spec_live())

    def reject(self, req: Request, error: str) -> None:
        """Finish ``req`` with ``error`` (it can never fit) and free what it holds."""
        if req in self.running:
            self.running.remove(req)
        self._release(req)
        req.error = error
        req.finished = True

    def abort(self, req: Request) -> None:
        """Drop ``req`` wherever it is (waiting or running) and free what it holds."""
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        self._release(req)
        req.finished = True

    def _spec_live(self) -> int:
        s = self.manager.stats()
        return s["stash_units"] + s["snapshot_slots"]

    def preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(req)

    def reserve(self, req: Request, tokens: int) -> bool:
        """Make room for ``req`` to hold ``tokens`` tokens, preempting the most recently
        admitted requests as needed. False if ``req`` itself was preempted or rejected (it
        cannot hold them even alone)."""
        while True:
            try:
                if self.ensure_tokens(req, tokens):
                    return True
            except _NeverFits as e:
                self.reject(req, str(e))
                return False
            if self.running == [req]:
                self.reject(
                    req,
                    f"memory_budget: request {req.index} needs {tokens} tokens of KV, more "
                    "than the arena holds with nothing else running",
                )
                return False
            victim = self.running[-1]
            self.preempt(victim)
            if victim is req:
                return False

    def finish(self, req: Request) -> None:
        req.finished = True
        self.running.remove(req)
        self._release(req)
