"""The simulated serving engine: one memory policy on one request trace.

What runs: the real :class:`serving.memory.MemoryManager` (one device arena, real on-device
copies when it compacts) under a scheduler model. Each step every running request allocates
its speculative scratch (one tree-WY ``stash`` unit, or ``spec_nodes`` per-node ``snapshot``
states for the vLLM/SGLang-style baseline), accepts a fixed number of tokens (its acceptance
length), grows its KV pages, and frees the scratch; then the scheduler admits waiting requests
in arrival order while their state slot and prompt KV pages fit and, in one joint dry run
(``MemoryManager.fits_all``), the whole batch's next scratch and ``RESERVE_TOKENS`` of KV
growth each still fit (head-of-line: it stops at the first that does not). On an allocation
failure the newest running request is preempted and later recomputed (vLLM's recompute
policy); a request that cannot run even alone (its state, prompt pages and one step's scratch)
is rejected.

Prefill: by default an admitted prompt is prefilled whole in its admission step.
``max_prefill_tokens`` caps the prompt tokens a step admits (whole prompts, one always fits).
``chunked_prefill`` is vLLM V1's and SGLang's default instead: a step processes at most that
many tokens, the decoding requests' verified nodes first, then the prefilling requests' next
chunks, then new admissions' first chunks; KV pages are allocated chunk by chunk (so a chunk
that does not fit preempts like any growth), and admission reserves the pages of every
prompt's chunks still to come. With a chunk above every step's tokens this is exactly the
default model.

Time: no model executes. A step lasts ``base + prefill_tokens * c_prefill + verified_nodes *
c_node`` simulated seconds (the config's ``cost``), plus a deterministic cost of the manager's
device work in the step: each compaction is one copy kernel (``COPY_LAUNCH_S``) reading and
writing its bytes at ``HBM_BYTES_PER_S``. Host-side manager time is measured and reported
(alloc p50/p99, ``host_step_s``) but not added to the clock, so the results do not depend on
the host's load. Page contents are not written; compaction copies are real.
"""

from __future__ import annotations

import math
import time
from collections import deque

import numpy as np

from benchmarks.memory_trace.workload import POLICY_ARGS, Cell
from serving.memory import (
    AllocationTooLargeError,
    HybridLayout,
    MemoryManager,
    OutOfMemoryError,
)

# Device cost of the manager's work, charged to simulated time: every compaction is one jitted
# copy kernel (launch overhead) that reads and writes the bytes it moves at the HBM bandwidth
# measured on the H200 (4.14 TB/s). Re-assigning a wholly free segment moves no bytes and
# costs no device time. Host-side bookkeeping is measured and reported but not charged: it is
# the host's noise, not a property of the policy, and a serving engine overlaps it with the
# previous step's device work.
HBM_BYTES_PER_S = 4.14e12
COPY_LAUNCH_S = 5e-6
RESERVE_TOKENS = 64  # KV growth per running request kept free at admission
# Log-spaced bins (0.1 us .. 10 s, ~2.3% wide) of per-call allocation latency: every run keeps
# a histogram so that a summary can give percentiles over all calls of all cells (pooled).
LAT_BINS_US = np.logspace(-1, 7, 801)
_ALLOC_ERRORS = (OutOfMemoryError, AllocationTooLargeError)


def _pages(tokens: int, tokens_per_page: int) -> int:
    """KV pages that hold ``tokens`` tokens."""
    return -(-tokens // tokens_per_page)


class Sim:
    """One policy on one request trace (see the module docstring for the scheduler).

    ``cost`` is ``(base s, s per prefill token, s per verified node)``; pass at most one of
    ``max_prefill_tokens`` and ``chunked_prefill``. :meth:`run` returns the run's metrics.
    """

    def __init__(
        self,
        layout: HybridLayout,
        budget: int,
        policy: str,
        cell: Cell,
        cost,
        max_prefill_tokens: int | None = None,
        chunked_prefill: int | None = None,
    ):
        if max_prefill_tokens and chunked_prefill:
            raise ValueError(
                "max_prefill_tokens (whole prompts) and chunked_prefill (prompts split into "
                "chunks) are two scheduler models: pass one of them"
            )
        for name, v in (
            ("max_prefill_tokens", max_prefill_tokens),
            ("chunked_prefill", chunked_prefill),
        ):
            if v is not None and (type(v) is not int or v < 1):
                raise ValueError(f"{name} must be a positive int or None, got {v!r}")
        self.mm = MemoryManager(layout, budget, policy, **POLICY_ARGS.get(policy, {}))
        self.max_prefill_tokens = max_prefill_tokens
        self.chunked_prefill = chunked_prefill
        self.natural = layout
        self.cell, self.cost = cell, cost
        self.lat_ns: list[int] = []  # wall time of every alloc call
        self.lat_n: list[int] = []  # units it asked for
        self.oom = self.preemptions = self.rejected = self.admission_stalls = 0
        self.finished = 0

    def _alloc(self, rid, kind, n):
        t0 = time.perf_counter_ns()
        try:
            return self.mm.alloc(rid, kind, n)
        finally:
            self.lat_ns.append(time.perf_counter_ns() - t0)
            self.lat_n.append(n)

    def run(self, req) -> dict:
        """Serve the requests of ``req`` (:func:`~benchmarks.memory_trace.workload.make_requests`)
        to the end; per-request latencies are ``None`` for a rejected request."""
        mm, lay = self.mm, self.natural
        n = len(req["arrival"])
        tpp = mm.tokens_per_page
        arrival, prompt, output, accept = (
            req[k] for k in ("arrival", "prompt", "output", "accept")
        )
        gen, pages = [0] * n, [0] * n
        # Chunked prefill: a running request whose ``filled`` prompt tokens (of ``target``:
        # prompt + tokens generated before a preemption) are not all in its KV cache yet is
        # still prefilling; it holds pages for ``filled`` tokens only and does not decode.
        # Without chunking every prompt is filled in its admission step.
        filled, target = [0] * n, [0] * n
        chunk = self.chunked_prefill
        done = np.full(n, np.nan)
        waiting: deque[int] = deque()
        running: list[int] = []
        scratch_kind = self.cell.spec
        scratch_n = 1 if scratch_kind == "stash" else lay.spec_nodes
        scratch_bytes = scratch_n * lay.unit_bytes(scratch_kind)
        base, c_pre, c_node = self.cost
        t, nxt, peak = 0.0, 0, 0
        util_area = host_s = manager_device_s = 0.0
        while self.finished < n:
            while nxt < n and arrival[nxt] <= t:
                waiting.append(nxt)
                nxt += 1
            if not running and not waiting:
                t = float(arrival[nxt])
                continue
            wall0 = time.perf_counter()
            moved0, copies0 = mm.migrated_bytes, mm.compactions
            preempted_before = self.preemptions
            # One verify step for the whole batch: every running request's scratch is live
            # at once, then each commits its accepted tokens and frees its scratch.
            batch = []
            for r in list(running):
                if r in running and filled[r] == target[r]:
                    got = self._grow(r, scratch_kind, scratch_n, running, waiting)
                    if got is not None:
                        batch.append((r, got))
            nodes = lay.spec_nodes * len(batch)
            for r, got in batch:
                if r not in running:
                    continue  # preempted by a later request's scratch: already freed
                gen[r] = min(int(output[r]), gen[r] + int(accept[r]))
                need = _pages(int(prompt[r]) + gen[r], tpp)
                if need > pages[r]:
                    if self._grow(r, "kv", need - pages[r], running, waiting) is None:
                        continue
                    pages[r] = need
                mm.free(r, scratch_kind, got)
                if gen[r] >= output[r]:
                    mm.free(r)
                    running.remove(r)
                    done[r] = -1.0  # stamped with the step's end time below
                    self.finished += 1
            prefill = 0
            # Chunked prefill (vLLM V1's ``max_num_batched_tokens`` with chunked prefill on,
            # SGLang's ``chunked_prefill_size``): the step's token budget goes to the decoding
            # requests' verified nodes first, then to the prefilling requests' next chunks in
            # running order (their KV pages are allocated chunk by chunk, preempting the newest
            # on OOM), then to new admissions' first chunks.
            budget = math.inf if chunk is None else max(0, chunk - nodes)
            for r in list(running):
                if budget <= 0:
                    break
                if r not in running or filled[r] == target[r]:
                    continue
                c = min(budget, target[r] - filled[r])
                need = _pages(filled[r] + c, tpp)
                if need > pages[r]:
                    if self._grow(r, "kv", need - pages[r], running, waiting) is None:
                        continue
                    pages[r] = need
                filled[r] += c
                budget -= c
                prefill += c
            # As vLLM's scheduler: running requests first; no new prefill in a step that
            # had to preempt (admitting then would only thrash).
            while waiting and self.preemptions == preempted_before and budget > 0:
                r = waiting[0]
                cap = self.max_prefill_tokens
                if cap and prefill and prefill + int(prompt[r]) + gen[r] > cap:
                    break  # the step's prefill token budget is spent (one prompt always fits)
                whole = int(prompt[r]) + gen[r]
                first = int(min(budget, whole))
                need = max(1, _pages(first, tpp))
                try:
                    self._alloc(r, "state", 1)
                    self._alloc(r, "kv", need)
                except _ALLOC_ERRORS as e:
                    if mm.handles(r):
                        mm.free(r)
                    if not running or isinstance(e, AllocationTooLargeError):
                        waiting.popleft()  # cannot run even alone
                        self.rejected += 1
                        self.finished += 1
                        continue
                    self.admission_stalls += 1
                    break
                # SGLang-style reservation: admit only while the batch (this request included)
                # keeps room for its next steps' scratch and RESERVE_TOKENS of KV growth each.
                # One joint dry run (scratch first, as a step allocates it), so a free segment
                # is not counted for both kinds. Alone, a request only needs room for its own
                # scratch; without it, it cannot run even alone and is rejected at once.
                # With chunked prefill the pages of every prompt's chunks still to come count
                # too (SGLang's admission counts whole prompts, though it allocates by chunk),
                # alone or not: without them it would be admitted only to be preempted.
                ahead = [*running, r]
                grow = sum(min(int(output[j]) - gen[j], RESERVE_TOKENS) for j in ahead)
                needs = [(scratch_kind, scratch_n * len(ahead))]
                prefilling = [j for j in running if filled[j] < target[j]]
                rest = _pages(whole, tpp) - need
                rest += sum(_pages(target[j], tpp) - pages[j] for j in prefilling)
                if running or rest:
                    needs.append(("kv", rest + (max(1, _pages(grow, tpp)) if running else 0)))
                if not mm.fits_all(needs):
                    mm.free(r)
                    if not running:
                        waiting.popleft()
                        self.rejected += 1
                        self.finished += 1
                        continue
                    self.admission_stalls += 1
                    break
                waiting.popleft()
                running.append(r)
                pages[r] = need
                filled[r], target[r] = first, whole
                budget -= first
                prefill += first
            if mm.migrated_bytes != moved0:
                mm.arena.buffer.block_until_ready()
            host_s += time.perf_counter() - wall0
            copies = mm.compactions - copies0
            device_s = copies * COPY_LAUNCH_S + 2 * (mm.migrated_bytes - moved0) / HBM_BYTES_PER_S
            manager_device_s += device_s
            step = base + prefill * c_pre + nodes * c_node + device_s
            peak = max(peak, len(running))
            needed = sum(
                lay.state_slot_bytes
                + (int(prompt[r]) + gen[r]) * lay.kv_bytes_per_token
                + scratch_bytes
                if filled[r] == target[r]
                else lay.state_slot_bytes + filled[r] * lay.kv_bytes_per_token
                for r in running
            )
            util_area += step * min(1.0, needed / mm.arena.nbytes)
            t += step
            done[done == -1.0] = t
        return self._metrics(t, done, arrival, peak, util_area, host_s, manager_device_s)

    def _metrics(self, t, done, arrival, peak, util_area, host_s, manager_device_s) -> dict:
        stats = self.mm.stats()
        lat = np.asarray(self.lat_ns) / 1e3
        completed = int(np.sum(~np.isnan(done)))
        return {
            "completed": completed,
            "rejected": self.rejected,
            "makespan_s": t,
            "requests_per_s": completed / t if t else 0.0,
            "oom_events": self.oom,
            "preemptions": self.preemptions,
            "admission_stalls": self.admission_stalls,
            "peak_concurrency": peak,
            "mem_utilisation": util_area / t if t else 0.0,
            "alloc_p50_us": float(np.percentile(lat, 50)),
            "alloc_p99_us": float(np.percentile(lat, 99)),
            "alloc_calls": len(lat),
            "alloc_p99_us_single": float(np.percentile(lat[np.asarray(self.lat_n) == 1], 99)),
            "alloc_over_50us": float(np.mean(lat > 50)),
            "_alloc_hist": np.histogram(np.clip(lat, 0.1, 1e7), LAT_BINS_US)[0],
            "host_step_s": host_s,
            "manager_device_s": manager_device_s,
            "migrations": stats["migrations"],
            "migrated_bytes": stats["migrated_bytes"],
            "compactions": stats["compactions"],
            "arena_bytes": stats["arena_bytes"],
            "tokens_per_page": stats["tokens_per_page"],
            "latency_s": [
                None if np.isnan(x) else float(x - a) for x, a in zip(done, arrival, strict=True)
            ],
        }

    def _grow(self, r, kind, count, running, waiting):
        """Allocate for running request ``r``, preempting the newest requests on OOM.
        Returns the handles, or ``None`` when ``r`` itself was preempted or rejected (it
        cannot run even alone)."""
        while True:
            try:
                return self._alloc(r, kind, count)
            except _ALLOC_ERRORS:
                self.oom += 1
                victim = running[-1]
                self.mm.free(victim)
                running.remove(victim)
                if victim != r:
                    self.preemptions += 1
                    waiting.appendleft(victim)
                    continue
                if running:
                    self.preemptions += 1
                    waiting.appendleft(victim)
                else:
                    self.rejected += 1
                    self.finished += 1
                return None
