"""The engine loop: admit, reserve memory, then one prefill step (a chunk of every prefilling
request) and one decode step (plain, or draft-verify-accept-commit) per iteration.

Batches are padded to power-of-two buckets (capped at ``max_num_seqs``), a prefill step's
chunks to ``prefill_chunk`` tokens, or to the smallest of ``prefill_buckets`` that holds its
longest chunk (:meth:`Engine.prefill_width`), and draft trees to the config's static ``N``
nodes, so the jitted steps compile once per bucket and never in a steady state.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from serving.acceptance import greedy_accept, rejection_accept, target_probs
from serving.drafters import ModelDrafter, MTPDrafter, NgramDrafter
from serving.params import SpecConfig
from serving.runner import ArenaRunner, ModelRunner
from serving.scheduler import Request, Scheduler
from serving.spec_device import DeviceSpeculator, sample_rows
from serving.spec_trees import TreeBuilder


def buckets_for(max_num_seqs: int) -> tuple[int, ...]:
    """Powers of two below ``max_num_seqs``, then ``max_num_seqs`` itself."""
    out = [1 << i for i in range(max_num_seqs.bit_length()) if 1 << i < max_num_seqs]
    return (*out, max_num_seqs)


class Engine:
    def __init__(
        self,
        runner: ArenaRunner | ModelRunner,
        scheduler: Scheduler,
        *,
        max_num_seqs: int,
        batch_buckets: tuple[int, ...],
        prefill_chunk: int,
        spec: SpecConfig | None,
        prefill_buckets: tuple[int, ...] = (),
        max_prefill_rows: int | None = None,
        drafter=None,
        draft_runner: ModelRunner | ArenaRunner | None = None,
        progress=None,
        num_scheduler_steps: int = 1,
        async_scheduling: bool = False,
    ):
        self.runner = runner
        self.num_scheduler_steps = num_scheduler_steps
        self.async_scheduling = async_scheduling
        self._inflight: _InFlight | None = None  # the dispatched, unfetched step (async scheduling)
        self.async_steps = 0  # steps fed on the device by the step still in flight
        self.sched = scheduler
        self.max_num_seqs = max_num_seqs
        self.buckets = tuple(sorted(batch_buckets))
        self.chunk = prefill_chunk
        self.prefill_buckets = tuple(sorted({*prefill_buckets, prefill_chunk}))
        self.max_prefill_rows = max_prefill_rows or max_num_seqs
        self.spec = spec
        self.drafter = drafter
        self.draft_runner = draft_runner
        self.progress = progress
        self.num_nodes = spec.num_nodes if spec else 1
        self.depth = spec.max_depth if spec else 0
        self.snapshot = bool(spec and spec.verify == "snapshot")
        self.device_spec = None
        if spec is not None:
            self.device_spec = _device_speculator(runner, spec, drafter, draft_runner)

    def prefill_width(self, longest: int) -> int:
        """Tokens per row of a prefill step whose longest chunk has ``longest`` tokens (at most
        ``prefill_chunk``): the smallest prefill bucket that holds it (``prefill_chunk`` when
        no smaller bucket was given)."""
        return next(w for w in self.prefill_buckets if w >= longest)

    def compiled(self) -> int:
        n = self.runner.compiled()
        if self.device_spec is not None:
            n += self.device_spec.compiled()
        if self.draft_runner is not None:
            n += self.draft_runner.compiled()
        if isinstance(self.drafter, MTPDrafter):
            n += self.drafter.compiled()
        return n

    # ------------------------------------------------------------------------------ batches

    def _rows(self, reqs: list[Request]):
        """The batch padded to its bucket: ``(target rows, draft rows)``, each ``(ids [B],
        page table [B, MP], lengths [B])``. The target's are the manager's handles (``state``
        handle, ``kv`` handles; ``-1`` padding) with the arena cache, else dense slot / page
        ids; the draft model's are the same handles when its cache shares the target's arena
        units (an arena draft runner), else dense ids of its own pools."""
        b = next(x for x in self.buckets if x >= len(reqs))
        mp = self.sched.pages_per_seq
        lens = np.zeros(b, np.int32)
        handles = np.full(b, -1, np.int32)
        kv = np.full((b, mp), -1, np.int32)
        draft_kind = self.draft_runner.kind if self.draft_runner is not None else None
        scratch = self.draft_runner.scratch if draft_kind == "pools" else 0
        if self.runner.kind == "pools":
            scratch = self.runner.scratch
        slots = np.full(b, scratch, np.int32)
        pages = np.full((b, mp), -1, np.int32)
        for i, r in enumerate(reqs):
            lens[i] = r.computed
            handles[i] = r.state_handle
            kv[i, : len(r.kv_handles)] = r.kv_handles
            slots[i] = r.slot
            pages[i, : len(r.pages)] = r.pages
        dense = (slots, pages, lens)
        arena = (handles, kv, lens)
        return (
            arena if self.runner.kind == "arena" else dense,
            arena if draft_kind == "arena" else dense,
        )

    def _scratch(self, reqs: list[Request], b: int) -> np.ndarray:
        """The target's speculative-scratch handles of the batch padded to ``b`` rows (arena
        cache): ``int32 [B]`` stash handles (tree WY) or ``int32 [B, N]`` snapshot handles, one
        per node; ``-1`` for padding rows, whose scratch writes are dropped."""
        shape = (b, self.num_nodes) if self.snapshot else (b,)
        out = np.full(shape, -1, np.int32)
        for i, r in enumerate(reqs):
            out[i] = r.spec_handles if self.snapshot else r.spec_handles[0]
        return out

    def _history(self, reqs: list[Request], b: int) -> np.ndarray:
        """The rows' tokens for the n-gram drafter on the device, ``int32 [b, L]`` with ``L``
        the tokens a row's pages hold: each request's prompt and output (its root last, at
        its length), zeros after."""
        out = np.zeros((b, self.sched.pages_per_seq * self.sched.page_size), np.int32)
        for i, r in enumerate(reqs):
            ctx = r.context()
            out[i, : len(ctx)] = ctx
        return out

    def _emit(self, req: Request, tokens: list[int], now: float) -> None:
        p = req.params
        for t in tokens:
            req.output.append(int(t))
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            if len(req.output) >= p.max_tokens or int(t) in p.stop_token_ids:
                self.sched.finish(req)
                break
        if self.progress is not None:
            self.progress(len(tokens))

    @staticmethod
    def _sampling(reqs: list[Request], b: int):
        """``(seeds uint32 [B, 3], temperature, top_k, top_p [B])`` of the batch padded to
        ``b`` rows (padding rows greedy): the rows' sampling parameters and random-stream keys
        ``(seed, request index, output position)`` for the device."""
        seeds = np.zeros((b, 3), np.uint32)
        temp = np.zeros(b, np.float32)
        top_k = np.zeros(b, np.int32)
        top_p = np.ones(b, np.float32)
        for i, r in enumerate(reqs):
            p = r.params
            seeds[i] = (p.seed % (1 << 32), r.index % (1 << 32), len(r.output))
            temp[i], top_k[i], top_p[i] = p.temperature, p.top_k, p.top_p
        return seeds, temp, top_k, top_p

    def _next_tokens(self, reqs: list[Request], logits, argmax) -> np.ndarray:
        """Each row's next token: the argmax, or for a batch that samples a draw on the device
        (:func:`serving.spec_device.sample_rows`), so no logits come to the host."""
        if all(r.params.greedy for r in reqs):
            return np.asarray(argmax)
        return np.asarray(sample_rows(logits, *self._sampling(reqs, logits.shape[0])))

    # -------------------------------------------------------------------------------- steps

    @property
    def _drafts_on_device(self) -> bool:
        """Whether the one-program speculative step drafts its trees itself: the draft model,
        the MTP head, the n-gram drafter (static and budget trees). Not for another host
        drafter put in the n-gram one's place (``engine.drafter = ...``, e.g. a replay
        drafter), whose trees the host builds and sends."""
        ds = self.device_spec
        if ds is None or not ds.chains:
            return False
        if isinstance(self.drafter, NgramDrafter):
            return ds.history and type(self.drafter) is NgramDrafter
        return True

    def _steps_ahead(self) -> int:
        """Steps this engine step runs back to back, up to ``num_scheduler_steps`` when no
        running request is prefilling: plain decode steps (:meth:`_decode_ahead`) or
        speculative steps drafted on the device (:meth:`_speculate_ahead`), greedy or
        sampled. Bounded by the fewest tokens a request may still emit and by the room left in
        its page table (``depth + 1`` tokens a speculative step); else 1."""
        k, s = self.num_scheduler_steps, self.sched
        if k < 2 or not s.running:
            return 1
        spec = self.spec is not None
        if spec and not self._drafts_on_device:
            return 1
        per_step = 1 + self.depth if spec else 1
        cap = s.pages_per_seq * s.page_size
        for r in s.running:
            if r.prefilling:
                return 1
            k = min(k, r.params.max_tokens - len(r.output), (cap - r.computed) // per_step)
        return max(k, 1)

    def step(self) -> None:
        if self.async_scheduling and (self.spec is None or self._drafts_on_device):
            if self._step_async():
                return
        self._drain()
        s = self.sched
        s.admit(self.max_num_seqs, self.chunk)
        ahead = self._steps_ahead()
        # reserve this step's tokens, oldest first; newest requests are preempted on OOM. At
        # most max_prefill_rows prefilling requests get a chunk this step (the oldest).
        prefills = []
        for req in list(s.running):
            if req not in s.running:
                continue
            if req.prefilling:
                if len(prefills) == self.max_prefill_rows:
                    continue
                todo = len(req.prefill_tokens) - req.computed
                s.reserve(req, req.computed + max(1, min(todo, self.chunk)))
                prefills.append(req)
            elif self.spec is not None:
                s.reserve(req, req.computed + ahead * (1 + self.depth))
            else:
                s.reserve(req, req.computed + ahead)
        prefills = [r for r in prefills if r in s.running]
        decodes = [r for r in s.running if not r.prefilling]
        if prefills:
            self._prefill(prefills)
        if decodes:
            if self.spec is not None and ahead > 1:
                self._speculate_ahead(decodes, ahead)
            elif self.spec is not None:
                self._speculate(decodes)
            elif ahead > 1:
                self._decode_ahead(decodes, ahead)
            else:
                self._decode(decodes)

    # ------------------------------------------------------------------- async scheduling

    def _step_async(self) -> bool:
        """One engine step overlapped with the device (vLLM's async scheduling): admit,
        reserve and dispatch step t+1 while step t is still on the device, t+1's rows fed
        their request's outputs of t there, then fetch step t's tokens and emit them. Plain
        decode steps (a row takes its request's token of t) and speculative steps drafted on
        the device (a row's root, length, random-stream position and MTP hidden state or
        n-gram tokens advance by what its request emitted in t: ``DeviceSpeculator.dispatch``).
        False when the step must run in order (:meth:`step`'s body, after :meth:`_drain`): a
        request prefills (admission), or no step is in flight and none can start.

        A request sure to finish in step t (its ``max_tokens``) is left out of t+1; one that
        stops there on a stop token, or reaches its limit on more tokens than one, is in t+1
        too, and its t+1 tokens are dropped. A request preempted while step t runs loses
        step t's tokens and recomputes them after readmission (same keys, same tokens).
        Writes of step t+1 into memory released by a request that finished in step t land
        before any later step reuses it (device order)."""
        s = self.sched
        s.admit(self.max_num_seqs, self.chunk)
        if any(r.prefilling for r in s.running):
            return False
        fl = self._inflight
        row_of = {} if fl is None else {id(r): i for i, r in enumerate(fl.reqs)}
        per_step = 1 + self.depth if self.spec is not None else 1

        def pending(r) -> int:  # steps of r in flight (at least one token each)
            return int(id(r) in row_of)

        for req in list(s.running):
            if req in s.running:
                s.reserve(req, req.computed + (pending(req) + 1) * per_step)
        reqs = [
            r for r in s.running if len(r.output) + pending(r) < r.params.max_tokens
        ]  # fmt: skip
        if not reqs:
            if fl is None:
                return False
            self._finish_inflight()
            return True
        rows, _ = self._rows(reqs)
        b = rows[0].shape[0]
        src = np.full(b, -1, np.int32)
        for i, r in enumerate(reqs):
            src[i] = row_of.get(id(r), -1)
        if fl is not None and (src >= 0).any():
            self.async_steps += 1
        if self.spec is not None:
            nxt = self._dispatch_spec(reqs, rows, src, fl)
        else:
            nxt = self._dispatch_decode(reqs, rows, src, fl)
        if fl is not None:
            self._finish_inflight()
        self._inflight = nxt
        return True

    def _dispatch_decode(self, reqs, rows, src, fl) -> _InFlight:
        ids, table, lengths = rows
        b = ids.shape[0]
        host = np.zeros(b, np.int32)
        for i, r in enumerate(reqs):
            if src[i] >= 0:
                lengths[i] += 1  # its token of the step in flight is cached by this one
            else:
                host[i] = r.output[-1]
        tokens = _feed(fl.tokens, src, host) if (src >= 0).any() else host
        logits, am, _ = self.runner.decode(ids, table, lengths, tokens)
        if all(r.params.greedy for r in reqs):
            nxt = am
        else:
            seeds, temp, top_k, top_p = self._sampling(reqs, b)
            seeds[:, 2] += (src >= 0).astype(np.uint32)  # this token's output position
            nxt = sample_rows(logits, seeds, temp, top_k, top_p)
        return _InFlight(reqs, [r.preemptions for r in reqs], nxt)

    def _dispatch_spec(self, reqs, rows, src, fl) -> _InFlight:
        b = rows[0].shape[0]
        root = np.zeros(b, np.int32)
        for i, r in enumerate(reqs):
            root[i] = r.output[-1]  # a fed row's is replaced on the device
        seeds, temp, top_k, top_p = self._sampling(reqs, b)
        hidden = None
        if isinstance(self.drafter, MTPDrafter):
            h = next(r.hidden for r in reqs if r.hidden is not None)
            hidden = np.zeros((b, h.shape[-1]), h.dtype)
            for i, r in enumerate(reqs):
                if src[i] < 0:
                    hidden[i] = r.hidden
        elif self.device_spec.history:
            hidden = self._history(reqs, b)
        packed, hid = self.device_spec.dispatch(
            *rows, root, self._scratch(reqs, b), seeds, temp, top_k, top_p, hidden=hidden,
            prev=None if fl is None else fl.tokens, prev_hidden=None if fl is None else fl.hidden,
            src=src,
        )  # fmt: skip
        return _InFlight(reqs, [r.preemptions for r in reqs], packed, hid)

    def _finish_inflight(self) -> None:
        """Fetches the step in flight and emits its tokens to the requests still running as
        they were when it was dispatched (not finished, not preempted since)."""
        fl, self._inflight = self._inflight, None
        spec = fl.tokens.ndim == 2  # a speculative step's packed tokens and counts
        mtp = spec and isinstance(self.drafter, MTPDrafter)
        out, hidden = jax.device_get((fl.tokens, fl.hidden if mtp else None))
        now = time.perf_counter()
        for i, r in enumerate(fl.reqs):
            if r.finished or r not in self.sched.running or r.preemptions != fl.epochs[i]:
                continue
            if not spec:
                r.computed += 1
                self._emit(r, [int(out[i])], now)
                continue
            m = int(out[i, -1])
            r.computed += m
            r.accept_lengths.append(m)
            if mtp:
                r.hidden = hidden[i]
            self._emit(r, [int(t) for t in out[i, :m]], now)

    def _drain(self) -> None:
        """Completes a decode step left in flight by :meth:`_step_async`."""
        if self._inflight is not None:
            self._finish_inflight()

    def _prefill(self, reqs: list[Request]) -> None:
        rows, draft_rows = self._rows(reqs)
        b = rows[0].shape[0]
        todos = [r.prefill_tokens[r.computed : r.computed + self.chunk] for r in reqs]
        tokens = np.zeros((b, self.prefill_width(max(map(len, todos)))), np.int32)
        counts = np.zeros(b, np.int32)
        for i, todo in enumerate(todos):
            tokens[i, : len(todo)] = todo
            counts[i] = len(todo)
        logits, am, hidden = self.runner.prefill(*rows, tokens, counts)
        if self.draft_runner is not None:
            self.draft_runner.prefill(*draft_rows, tokens, counts)
        done = [i for i, r in enumerate(reqs) if r.computed + counts[i] == len(r.prefill_tokens)]
        if done:
            first = self._next_tokens(reqs, logits, am)
            hidden_h = np.asarray(hidden) if isinstance(self.drafter, MTPDrafter) else None
        now = time.perf_counter()
        for i, r in enumerate(reqs):
            r.computed += int(counts[i])
        for i in done:
            r = reqs[i]
            if hidden_h is not None:
                r.hidden = hidden_h[i]
            if not r.output:  # a fresh request: its first token
                self._emit(r, [int(first[i])], now)

    def _decode(self, reqs: list[Request]) -> None:
        rows, _ = self._rows(reqs)
        tokens = np.zeros(rows[0].shape[0], np.int32)
        for i, r in enumerate(reqs):
            tokens[i] = r.output[-1]
        logits, am, _ = self.runner.decode(*rows, tokens)
        nxt = self._next_tokens(reqs, logits, am)
        now = time.perf_counter()
        for i, r in enumerate(reqs):
            r.computed += 1
            self._emit(r, [int(nxt[i])], now)

    def _decode_ahead(self, reqs: list[Request], steps: int) -> None:
        """``steps`` decode steps dispatched back to back, each fed the previous step's
        tokens on the device (the argmax, or for a batch that samples a draw of
        :func:`serving.spec_device.sample_rows` keyed by each row's output position, the key
        one step at a time would use), so the host's work for a step overlaps the device's for
        the one before; the tokens come to the host once, at the end. A request that stops
        early (a stop token, or ``max_tokens``) keeps only its tokens up to the stop; the
        steps after it wrote into its reserved pages, which it releases when it finishes."""
        (ids, table, lengths), _ = self._rows(reqs)
        b = ids.shape[0]
        tokens = np.zeros(b, np.int32)
        for i, r in enumerate(reqs):
            tokens[i] = r.output[-1]
        live = (np.arange(b) < len(reqs)).astype(np.int32)  # padding rows stay at 0
        sampling = None if all(r.params.greedy for r in reqs) else self._sampling(reqs, b)
        out = []
        for j in range(steps):
            logits, tokens, _ = self.runner.decode(ids, table, lengths + j * live, tokens)
            if sampling is not None:
                seeds, temp, top_k, top_p = sampling
                seeds = seeds.copy()
                seeds[:, 2] += np.uint32(j) * live.astype(np.uint32)  # the output position
                tokens = sample_rows(logits, seeds, temp, top_k, top_p)
            out.append(tokens)
        out = np.stack([np.asarray(t) for t in out])  # [steps, B]
        now = time.perf_counter()
        for i, r in enumerate(reqs):
            for j in range(steps):
                if r.finished:
                    break
                r.computed += 1
                self._emit(r, [int(out[j, i])], now)

    def _speculate_on_device(self, reqs: list[Request]) -> None:
        """One device program: draft, verify, accept, commit (:mod:`serving.spec_device`)."""
        rows, _ = self._rows(reqs)
        b = rows[0].shape[0]
        root = np.zeros(b, np.int32)
        for i, r in enumerate(reqs):
            root[i] = r.output[-1]
        seeds, temp, top_k, top_p = self._sampling(reqs, b)
        kw = {}
        if isinstance(self.drafter, MTPDrafter):
            h = reqs[0].hidden
            hidden = np.zeros((b, h.shape[-1]), h.dtype)
            for i, r in enumerate(reqs):
                hidden[i] = r.hidden
            kw["hidden"] = hidden
        elif isinstance(self.drafter, NgramDrafter) and self._drafts_on_device:
            # n-gram lookups on the device, in the rows' tokens
            kw["hidden"] = self._history(reqs, b)
        elif isinstance(self.drafter, NgramDrafter):  # trees from the host's n-gram lookups
            builders = [TreeBuilder(r.output[-1], self.spec, None) for r in reqs]
            self.drafter.draft([r.context() for r in reqs], builders)
            tokens = np.zeros((b, self.num_nodes), np.int32)
            parents = np.full((b, self.num_nodes), -2, np.int32)
            parents[:, 0] = -1
            for i, tb in enumerate(builders):
                tokens[i], parents[i] = tb.arrays(self.num_nodes)
            kw.update(tokens=tokens, parents=parents)
            forced = getattr(self.drafter, "forced_targets", None)  # a benchmark's replay
            if forced is not None:
                kw["forced"] = forced(builders, b, self.num_nodes)
        out, counts, hidden = self.device_spec(  # host arrays
            *rows, root, self._scratch(reqs, b), seeds, temp, top_k, top_p, **kw
        )
        now = time.perf_counter()
        for i, r in enumerate(reqs):
            m = int(counts[i])
            r.computed += m
            if isinstance(self.drafter, MTPDrafter):
                r.hidden = hidden[i]
            r.accept_lengths.append(m)
            self._emit(r, [int(t) for t in out[i, :m]], now)

    def _speculate_ahead(self, reqs: list[Request], steps: int) -> None:
        """``steps`` speculative steps back to back, each fed the previous one's tokens on the
        device (:meth:`serving.spec_device.DeviceSpeculator.ahead`); the tokens come to the
        host once, at the end. A request that stops early keeps only its tokens up to the
        stop (the later steps wrote into its reserved pages, released when it finishes)."""
        rows, _ = self._rows(reqs)
        b = rows[0].shape[0]
        root = np.zeros(b, np.int32)
        for i, r in enumerate(reqs):
            root[i] = r.output[-1]
        seeds, temp, top_k, top_p = self._sampling(reqs, b)
        hidden = None
        if isinstance(self.drafter, MTPDrafter):
            h = reqs[0].hidden
            hidden = np.zeros((b, h.shape[-1]), h.dtype)
            for i, r in enumerate(reqs):
                hidden[i] = r.hidden
        elif self.device_spec.history:
            hidden = self._history(reqs, b)
        out, counts, hidden = self.device_spec.ahead(
            *rows, root, self._scratch(reqs, b), seeds, temp, top_k, top_p,
            steps=steps, hidden=hidden,
        )  # fmt: skip
        now = time.perf_counter()
        for i, r in enumerate(reqs):
            for j in range(steps):
                if r.finished:
                    break
                m = int(counts[j, i])
                r.computed += m
                r.accept_lengths.append(m)
                self._emit(r, [int(t) for t in out[j, i, :m]], now)
            if hidden is not None and not r.finished:
                r.hidden = hidden[i]

    def _speculate(self, reqs: list[Request]) -> None:
        if self.device_spec is not None:
            return self._speculate_on_device(reqs)
        spec, n = self.spec, self.num_nodes
        rows, draft_rows = self._rows(reqs)
        b = rows[0].shape[0]
        builders = []
        for r in reqs:
            rng = None
            if not r.params.greedy:
                rng = np.random.default_rng([r.params.seed, r.index, len(r.output), 1])
            builders.append(TreeBuilder(r.output[-1], spec, rng))
        temps = [r.params.temperature for r in reqs]
        self.drafter.draft(
            [r.context() for r in reqs],
            builders,
            rows=draft_rows,
            temperature=max(temps) if len(set(temps)) == 1 else 1.0,
            hidden=[r.hidden for r in reqs],
        )
        tokens = np.zeros((b, n), np.int32)
        parents = np.full((b, n), -2, np.int32)
        parents[:, 0] = -1
        for i, tb in enumerate(builders):
            tokens[i], parents[i] = tb.arrays(n)
        # the arena runner writes the tree state into the requests' scratch units and returns
        # their handles as ``tree``; the pools runner returns it as a device value
        kw = {"scratch": self._scratch(reqs, b)} if self.runner.kind == "arena" else {}
        logits, am, hidden, tree = self.runner.verify(
            *rows, tokens, parents, snapshot=self.snapshot, **kw
        )
        am = np.asarray(am)
        logits_h = None if all(r.params.greedy for r in reqs) else np.asarray(logits)
        paths = np.full((b, self.depth + 1), -1, np.int32)
        path_len = np.zeros(b, np.int32)
        nexts = []
        for i, (r, tb) in enumerate(zip(reqs, builders, strict=True)):
            if r.params.greedy:
                path, nxt = greedy_accept(tb, am[i])
            else:
                rng = np.random.default_rng([r.params.seed, r.index, len(r.output), 2])
                probs = target_probs(logits_h[i, : len(tb)], r.params)
                path, nxt = rejection_accept(tb, probs, rng)
            paths[i, : len(path)] = path
            path_len[i] = len(path)
            nexts.append(nxt)
        self.runner.commit(*rows, tree, paths, path_len)
        del tree  # pools: the transient tree state, freed before the next step
        if self.draft_runner is not None:
            chunk = np.zeros((b, self.depth + 1), np.int32)
            for i in range(len(reqs)):
                chunk[i, : path_len[i]] = tokens[i, paths[i, : path_len[i]]]
            self.draft_runner.prefill(*draft_rows, chunk, path_len)
        if isinstance(self.drafter, MTPDrafter):
            hidden = np.asarray(hidden)
        now = time.perf_counter()
        for i, (r, tb) in enumerate(zip(reqs, builders, strict=True)):
            m = int(path_len[i])
            r.computed += m
            if isinstance(self.drafter, MTPDrafter):
                r.hidden = hidden[i, paths[i, m - 1]]
            r.accept_lengths.append(m)
            self._emit(r, [tb.tokens[j] for j in paths[i, 1:m]] + [nexts[i]], now)


class _InFlight:
    """A step dispatched and not fetched: its requests (row order), their preemption counts
    when dispatched, and on the device its next tokens (decode: ``[B]``; speculative: the
    emitted tokens then their count, ``[B, depth + 2]``) and the drafter's ``hidden``."""

    def __init__(self, reqs: list[Request], epochs: list[int], tokens, hidden=None):
        self.reqs, self.epochs, self.tokens, self.hidden = reqs, epochs, tokens, hidden


@jax.jit
def _feed(prev, src, host):
    """The next decode step's tokens on the device: row ``i`` takes ``prev[src[i]]`` (the
    in-flight step's token of its request) where ``src[i] >= 0``, else ``host[i]``."""
    return jnp.where(src >= 0, prev[jnp.maximum(src, 0)], host).astype(jnp.int32)


def _device_speculator(runner, spec: SpecConfig, drafter, draft_runner):
    """The one-program speculative step for this engine, or ``None`` where the host's
    multi-program path runs: the pooled cache, a draft model that keeps its own pools."""
    if runner.kind != "arena":
        return None
    if isinstance(drafter, ModelDrafter):
        if draft_runner is None or draft_runner.kind != "arena":
            return None
        return DeviceSpeculator(runner, spec, drafter="draft_model", draft_runner=draft_runner)
    if isinstance(drafter, MTPDrafter):
        return DeviceSpeculator(runner, spec, drafter="mtp")
    return DeviceSpeculator(runner, spec, drafter="ngram")


def make_drafter(spec: SpecConfig, vocab: int, draft_runner, mtp_runner):
    if spec.method == "ngram":
        return NgramDrafter(spec.ngram_max, vocab)
    if spec.method == "draft_model":
        return ModelDrafter(draft_runner, spec.num_nodes)
    return MTPDrafter(mtp_runner)
