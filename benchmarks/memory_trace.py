"""Trace-replay study of the memory policies (issue 5): AVMP against three baselines.

    python -m benchmarks.memory_trace --preset smoke          # < 1 min on CPU
    python -m benchmarks.memory_trace --preset full --json out.json --png out.png
    python -m benchmarks.memory_trace --preset full --chunked-prefill 8192 --workers 2
    python -m benchmarks.memory_trace --cell qwen3.5-397b/shift/short/bursty/loose/stash --seeds 20

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
is rejected. All policies see the same requests (paired), at the same byte budget.

Prefill: by default an admitted prompt is prefilled whole in its admission step.
``--max-prefill-tokens N`` caps the prompt tokens a step admits (whole prompts, one always
fits). ``--chunked-prefill N`` is vLLM V1's and SGLang's default instead: a step processes at
most ``N`` tokens, the decoding requests' verified nodes first, then the prefilling requests'
next chunks, then new admissions' first chunks; KV pages are allocated chunk by chunk (so a
chunk that does not fit preempts like any growth), and admission reserves the pages of every
prompt's chunks still to come. With ``N`` above every step's tokens this is exactly the default
model. ``--cell NAME --seeds K`` re-runs single cells of the full grid on K request draws
(``seed_sweep``): is a cell's verdict a property of its configuration or of one draw?

What is modelled, not run: no model executes. A step lasts ``base + prefill_tokens * c_prefill
+ verified_nodes * c_node`` simulated seconds (constants in ``CONFIGS``, H200-order guesses;
only ratios between policies are meant to be read), plus a deterministic cost of the manager's
device work in the step: each compaction is one copy kernel (``COPY_LAUNCH_S``) reading and
writing its bytes at ``HBM_BYTES_PER_S``. Host-side manager time is measured and reported
separately (alloc p50/p99, ``host_step_s``) but not added to the clock, so the verdicts do not
depend on this host's load. Requests/s, latencies and utilisation are in simulated time. Page
contents are not written (the tests check that migration preserves contents); compaction
copies are real. A request that cannot run even alone is rejected; the paired latency
comparison censors it at the cell's horizon (see ``run_cell``).

Scaling: the big configs keep the first 4 layers (3 GDN + 1 attention, one period of the
3:1 pattern; ``layout_for(..., num_layers=4)``) so that the arena is a few hundred MB on a CPU
while the KV-bytes-per-token to state-slot ratio, which decides every trade-off here, is the
full model's. Budgets are set in state slots of that scaled layout.

ShareGPT-like lengths: lognormal prompt and output lengths with the means reported for
ShareGPT in the vLLM paper (Kwon et al., "Efficient Memory Management for Large Language Model
Serving with PagedAttention", SOSP 2023, section 6.1 / Fig. 11: mean input 161.31 tokens,
mean output 337.99 tokens); the spread (sigma = 1.0) is our choice, not a published number.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import platform
import sys
import time
from collections import deque

import jax
import numpy as np

from serving.memory import (
    AllocationTooLargeError,
    HybridLayout,
    MemoryManager,
    OutOfMemoryError,
    layout_for,
)

POLICIES = ("avmp", "unified_padded", "static_dual", "multi_ended")
POLICY_ARGS = {"static_dual": {"ratio": 0.9}}  # SGLang's default mamba_full_memory_ratio

# Cache geometry of the public configs (text_config of Qwen/Qwen3.5-35B-A3B and
# Qwen/Qwen3.5-397B-A17B, see /shared/configs), plus a tiny model. cost = (step base s,
# s per prefill token, s per verified draft node) of the scheduler's time model.
_QWEN35 = {
    "full_attention_interval": 4,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
}
CONFIGS = {
    "tiny": {
        "config": {
            "num_hidden_layers": 4,
            "full_attention_interval": 4,
            "num_key_value_heads": 1,
            "head_dim": 64,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 32,
            "linear_conv_kernel_dim": 4,
        },
        "cost": (2e-3, 2e-6, 1e-6),
    },
    "qwen3.5-35b": {
        "config": dict(_QWEN35, num_hidden_layers=40, linear_num_value_heads=32),
        "cost": (12e-3, 25e-6, 8e-6),
    },
    "qwen3.5-397b": {
        "config": dict(_QWEN35, num_hidden_layers=60, linear_num_value_heads=64),
        "cost": (30e-3, 90e-6, 25e-6),
    },
}
# Deterministic device-cost model of the manager's work, charged to simulated time: every
# compaction is one jitted copy kernel (launch overhead) that reads and writes the bytes it
# moves at the HBM bandwidth measured on the H200 (benchmarks/README.md, "Kernels": 4.14 TB/s).
# Re-assigning a wholly free segment moves no bytes and costs no device time. Host-side
# bookkeeping is measured (alloc p50/p99, host_manager_s) and reported, but not added to the
# simulated clock: it is this shared CPU's noise, not a property of the policy, and a serving
# engine overlaps it with the previous step's device work.
HBM_BYTES_PER_S = 4.14e12
COPY_LAUNCH_S = 5e-6
RESERVE_TOKENS = 64  # KV growth per running request kept free at admission
# Log-spaced bins (0.1 us .. 10 s, ~2.3% wide) of per-call allocation latency: every cell keeps
# a histogram so the summary can give percentiles over all calls of all cells (pooled).
LAT_BINS_US = np.logspace(-1, 7, 801)
SHAREGPT_MEANS = (161.31, 337.99)  # input, output tokens (vLLM paper, see module docstring)


@dataclasses.dataclass(frozen=True)
class Cell:
    config: str
    prompt: str  # short | long | shift (short first half, long second half) | sharegpt
    output: str  # short | long | mixed | sharegpt
    arrival: str  # poisson | bursty | batch
    budget: str  # tight | loose
    spec: str  # stash (tree WY) | snapshot (per-node states)

    @property
    def name(self) -> str:
        return "/".join(dataclasses.astuple(self))


PRESETS = {
    "smoke": dict(
        requests=24,
        page_size=32,
        spec_nodes=8,
        budgets={"tight": 12, "loose": 32},
        cells=[
            Cell("tiny", "shift", "short", "poisson", "tight", "stash"),
            Cell("tiny", "short", "mixed", "bursty", "tight", "snapshot"),
            Cell("qwen3.5-35b", "shift", "short", "batch", "tight", "stash"),
            Cell("qwen3.5-35b", "sharegpt", "sharegpt", "poisson", "tight", "stash"),
        ],
    ),
    "full": dict(
        requests=64,
        page_size=32,
        spec_nodes=8,
        budgets={"tight": 12, "loose": 32},
        cells=[
            Cell(*c)
            for c in itertools.product(
                CONFIGS,
                ("short", "long", "shift"),
                ("short", "long", "mixed"),
                ("poisson", "bursty", "batch"),
                ("tight", "loose"),
                ("stash", "snapshot"),
            )
        ]
        + [
            Cell(c, "sharegpt", "sharegpt", a, b, "stash")
            for c in CONFIGS
            for a in ("poisson", "bursty")
            for b in ("tight", "loose")
        ],
    ),
}


# Per-policy metrics of the summary table (means over cells), in table order.
TABLE_KEYS = (
    "requests_per_s",
    "completed",
    "rejected",
    "preemptions",
    "oom_events",
    "peak_concurrency",
    "mem_utilisation",
    "alloc_p50_us",
    "alloc_p99_us",
    "alloc_p99_us_single",
    "migrations",
    "migrated_bytes",
)


def _lognormal(rng, mean, sigma, n, lo, hi):
    mu = math.log(mean) - sigma * sigma / 2
    return np.clip(rng.lognormal(mu, sigma, n), lo, hi).astype(np.int64)


def make_requests(cell: Cell, n: int, seed: int, base_step: float) -> dict[str, np.ndarray]:
    """Arrival time, prompt and output length, and acceptance length per request."""
    rng = np.random.default_rng(seed)
    short, long_ = _lognormal(rng, 256, 0.8, n, 16, 4096), _lognormal(rng, 2048, 0.5, n, 256, 8192)
    prompt = {
        "short": short,
        "long": long_,
        "sharegpt": _lognormal(rng, SHAREGPT_MEANS[0], 1.0, n, 4, 4096),
        "shift": np.where(np.arange(n) < n // 2, short, long_),
    }[cell.prompt]
    out_s, out_l = _lognormal(rng, 64, 0.8, n, 4, 1024), _lognormal(rng, 384, 0.5, n, 32, 2048)
    output = {
        "short": out_s,
        "long": out_l,
        "mixed": np.where(rng.random(n) < 0.5, out_s, out_l),
        "sharegpt": _lognormal(rng, SHAREGPT_MEANS[1], 1.0, n, 4, 2048),
    }[cell.output]
    accept = rng.integers(1, 5, n)  # tokens accepted per verify step
    # Offer ~24 concurrent requests' worth of work: more than a tight budget holds.
    rate = 24 / (float(np.mean(output / accept)) * base_step)
    if cell.arrival == "poisson":
        arrival = np.cumsum(rng.exponential(1 / rate, n))
    elif cell.arrival == "bursty":
        bursts = np.cumsum(rng.exponential(8 / rate, -(-n // 8)))
        arrival = np.repeat(bursts, 8)[:n]
    else:
        arrival = np.zeros(n)
    return {"arrival": arrival, "prompt": prompt, "output": output, "accept": accept}


class Sim:
    """One policy on one request trace (see the module docstring for the scheduler)."""

    def __init__(
        self, layout: HybridLayout, budget: int, policy: str, cell: Cell, cost,
        max_prefill_tokens: int | None = None, chunked_prefill: int | None = None,
    ):  # fmt: skip
        if max_prefill_tokens and chunked_prefill:
            raise ValueError(
                "max_prefill_tokens (whole prompts) and chunked_prefill (prompts split into "
                "chunks) are two scheduler models: pass one of them")
        for name, v in (("max_prefill_tokens", max_prefill_tokens),
                        ("chunked_prefill", chunked_prefill)):
            if v is not None and (type(v) is not int or v < 1):
                raise ValueError(f"{name} must be a positive int or None, got {v!r}")
        self.mm = MemoryManager(layout, budget, policy, **POLICY_ARGS.get(policy, {}))
        self.max_prefill_tokens = max_prefill_tokens
        self.chunked_prefill = chunked_prefill
        self.natural = layout
        self.cell, self.cost = cell, cost
        self.lat_ns: list[int] = []
        self.lat_n: list[int] = []
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
                need = -(-(int(prompt[r]) + gen[r]) // tpp)
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
                need = -(-(filled[r] + c) // tpp)
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
                need = max(1, -(-first // tpp))
                try:
                    self._alloc(r, "state", 1)
                    self._alloc(r, "kv", need)
                except (OutOfMemoryError, AllocationTooLargeError) as e:
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
                rest = -(-whole // tpp) - need + sum(
                    -(-target[j] // tpp) - pages[j] for j in running if filled[j] < target[j])
                if running or rest:
                    needs.append(("kv", rest + (max(1, -(-grow // tpp)) if running else 0)))
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
            device_s = (mm.compactions - copies0) * COPY_LAUNCH_S + 2 * (
                mm.migrated_bytes - moved0
            ) / HBM_BYTES_PER_S
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
        stats = mm.stats()
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
            except (OutOfMemoryError, AllocationTooLargeError):
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


def paired_bootstrap(a: np.ndarray, b: np.ndarray, rng, reps: int = 2000):
    """95% CI of mean(b - a) over the requests both have a latency for (positive: ``a`` is
    faster)."""
    ok = ~(np.isnan(a) | np.isnan(b))
    d = (b - a)[ok]
    if d.size == 0:
        return None
    means = d[rng.integers(0, d.size, (reps, d.size))].mean(axis=1)
    return float(d.mean()), float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def run_cell(cell: Cell, preset: dict, seed: int) -> dict:
    spec = CONFIGS[cell.config]
    layout = layout_for(
        spec["config"], preset["page_size"], num_layers=4, spec_nodes=preset["spec_nodes"]
    )
    budget = preset["budgets"][cell.budget] * layout.state_slot_bytes
    req = make_requests(cell, preset["requests"], seed, spec["cost"][0])
    out = {
        "cell": dataclasses.asdict(cell),
        "name": cell.name,
        "budget_bytes": budget,
        "policies": {},
    }
    for policy in POLICIES:
        out["policies"][policy] = Sim(
            layout, budget, policy, cell, spec["cost"], preset.get("max_prefill_tokens"),
            preset.get("chunked_prefill"),
        ).run(req)
    rng = np.random.default_rng(seed)
    lat, censored = _latencies(out, req["arrival"])
    out["horizon_s"] = max(m["makespan_s"] for m in out["policies"].values())

    def verdict_of(ci):
        if ci is None:
            return "n/a"
        return "avmp better" if ci[1] > 0 else "avmp worse" if ci[2] < 0 else "tie"

    out["ci_latency_s"], out["ci_latency_common_s"] = {}, {}
    for base in POLICIES[1:]:
        for key, arrays in (("ci_latency_s", censored), ("ci_latency_common_s", lat)):
            ci = paired_bootstrap(arrays["avmp"], arrays[base], rng)
            out[key][base] = {
                "mean_gain": ci and ci[0],
                "lo": ci and ci[1],
                "hi": ci and ci[2],
                "verdict": verdict_of(ci),
            }
    return out


def _latencies(out: dict, arrival: np.ndarray) -> tuple[dict, dict]:
    """Per-policy request latencies of a :func:`run_cell` result (NaN: not completed), and the
    same censored for the primary comparison (below)."""
    lat = {
        p: np.array([np.nan if x is None else x for x in m["latency_s"]])
        for p, m in out["policies"].items()
    }
    # A rejected request (it could not run even alone under that policy) never gets an answer.
    # Comparing only the requests both policies completed would reward rejecting the big
    # ones (less queueing for the rest), so the primary comparison censors a rejected
    # request's latency at the cell's horizon (the latest makespan of any policy), the same
    # horizon for every policy: a lower bound on what the rejection cost its user. Requests
    # no policy completed are left out. The completed-by-both comparison is kept as well.
    horizon = max(m["makespan_s"] for m in out["policies"].values())
    served = ~np.all(np.isnan(np.stack(list(lat.values()))), axis=0)
    censored = {
        p: np.where(np.isnan(x), horizon - arrival, x)[served] for p, x in lat.items()
    }
    return lat, censored


SWEEP_SEED_STRIDE = 1000  # seed k of a cell: its study seed (grid index) + k * this


def seed_sweep(cells: list[Cell], preset: dict, seeds: int, base_seed: int = 0) -> dict:
    """Re-run named cells of the full grid at ``seeds`` seeds each: seed 0 is the study's own
    (``base_seed`` + the cell's index in the grid), seed k adds ``k * SWEEP_SEED_STRIDE``.
    Per baseline: the per-seed verdicts of the study's test, and one paired bootstrap over
    the censored latencies of every seed's requests together (is a per-seed verdict a
    property of the cell's configuration, or of one draw of its requests?), and the
    geometric-mean throughput ratio over seeds."""
    grid = [c.name for c in PRESETS["full"]["cells"]]
    out = {}
    for cell in cells:
        spec = CONFIGS[cell.config]
        runs, diffs = [], {b: ([], []) for b in POLICIES[1:]}
        for k in range(seeds):
            seed = base_seed + grid.index(cell.name) + k * SWEEP_SEED_STRIDE
            r = run_cell(cell, preset, seed)
            arrival = make_requests(cell, preset["requests"], seed, spec["cost"][0])["arrival"]
            _, censored = _latencies(r, arrival)
            for b in POLICIES[1:]:
                diffs[b][0].append(censored["avmp"])
                diffs[b][1].append(censored[b])
            runs.append({
                "seed": seed,
                "verdicts": {b: r["ci_latency_s"][b]["verdict"] for b in POLICIES[1:]},
                "mean_gain_s": {b: r["ci_latency_s"][b]["mean_gain"] for b in POLICIES[1:]},
                "requests_per_s": {p: m["requests_per_s"] for p, m in r["policies"].items()},
            })  # fmt: skip
        rng = np.random.default_rng(base_seed)
        per_base = {}
        for b in POLICIES[1:]:
            ci = paired_bootstrap(np.concatenate(diffs[b][0]), np.concatenate(diffs[b][1]), rng)
            verdicts = [x["verdicts"][b] for x in runs]
            ratios = [x["requests_per_s"]["avmp"] / x["requests_per_s"][b] for x in runs]
            per_base[b] = {
                "seeds_better": verdicts.count("avmp better"),
                "seeds_tie": verdicts.count("tie"),
                "seeds_worse": verdicts.count("avmp worse"),
                "seeds_mean_gain_negative": sum(x["mean_gain_s"][b] < 0 for x in runs),
                "pooled_mean_gain_s": ci[0], "pooled_lo": ci[1], "pooled_hi": ci[2],
                "throughput_ratio_geomean": float(np.exp(np.mean(np.log(ratios)))),
            }  # fmt: skip
        out[cell.name] = {"seeds": runs, "vs": per_base}
    return out


def print_sweep(sweep: dict, seeds: int) -> None:
    print(f"| cell | vs | seeds better / tie / worse (of {seeds}) | seeds with mean gain < 0 "
          "| pooled mean latency gain s [95% CI] | throughput ratio (geomean) |")
    print("|---|---|---|---|---|---|")
    for name, res in sweep.items():
        for b, v in res["vs"].items():
            print(f"| {name} | {b} | {v['seeds_better']} / {v['seeds_tie']} / "
                  f"{v['seeds_worse']} | {v['seeds_mean_gain_negative']} | "
                  f"{v['pooled_mean_gain_s']:+.3f} [{v['pooled_lo']:+.3f}, "
                  f"{v['pooled_hi']:+.3f}] | {v['throughput_ratio_geomean']:.3f} |")


def summarise(results: list[dict], seed: int) -> dict:
    """Across cells: per policy means, and AVMP/baseline throughput ratio with a paired
    bootstrap over cells (geometric mean)."""
    rng = np.random.default_rng(seed)
    summary = {}
    for p in POLICIES:
        rows = [r["policies"][p] for r in results]
        summary[p] = {
            k: float(np.mean([x[k] for x in rows]))
            for k in (*TABLE_KEYS, "host_step_s", "manager_device_s")
        }
        summary[p]["alloc_p99_us_max"] = float(max(x["alloc_p99_us"] for x in rows))
        # Pooled over every allocation call of every cell (from the per-cell histograms; the
        # value is the upper edge of the bin that holds the percentile: ~2% resolution).
        hist = np.sum([x["_alloc_hist"] for x in rows], axis=0)
        cum = np.cumsum(hist) / hist.sum()
        for q in (50, 99):
            summary[p][f"alloc_p{q}_us_pooled"] = float(
                LAT_BINS_US[1:][np.searchsorted(cum, q / 100)]
            )
        summary[p]["alloc_calls"] = int(hist.sum())
        summary[p]["alloc_over_50us_pooled"] = float(
            hist[LAT_BINS_US[:-1] >= 50].sum() / hist.sum()
        )

    def worse_any(r):
        return any(r["ci_latency_s"][b]["verdict"] == "avmp worse" for b in POLICIES[1:])

    def better_all(r):
        return all(r["ci_latency_s"][b]["verdict"] == "avmp better" for b in POLICIES[1:])

    def ratio_best(r):
        best = max(r["policies"][b]["requests_per_s"] for b in POLICIES[1:])
        return r["policies"]["avmp"]["requests_per_s"] / best if best > 0 else math.inf

    shift = [r for r in results if r["cell"]["prompt"] == "shift"]
    summary["targets"] = {
        "cells": len(results),
        "cells_avmp_worse_than_some_baseline": [r["name"] for r in results if worse_any(r)],
        "cells_avmp_better_than_every_baseline": sum(better_all(r) for r in results),
        "shift_cells": len(shift),
        "shift_cells_avmp_better_than_every_baseline": sum(better_all(r) for r in shift),
        "shift_cells_avmp_worse_than_some_baseline": sum(worse_any(r) for r in shift),
        "shift_throughput_vs_best_baseline_geomean": (
            math.exp(np.mean([math.log(x) for x in map(ratio_best, shift) if 0 < x < math.inf]))
            if shift
            else None
        ),
    }
    for base in POLICIES[1:]:
        # Cells where either side completed nothing have no finite ratio: counted apart.
        pairs = [
            (r["policies"]["avmp"]["requests_per_s"], r["policies"][base]["requests_per_s"])
            for r in results
        ]
        logr = np.array([math.log(a / b) for a, b in pairs if a > 0 and b > 0])
        boots = logr[rng.integers(0, logr.size, (2000, logr.size))].mean(axis=1)
        verdicts = [r["ci_latency_s"][base]["verdict"] for r in results]
        common = [r["ci_latency_common_s"][base]["verdict"] for r in results]
        summary[f"avmp_vs_{base}"] = {
            "throughput_ratio_geomean": math.exp(logr.mean()),
            "ci95": [math.exp(np.percentile(boots, 2.5)), math.exp(np.percentile(boots, 97.5))],
            "cells_only_avmp_completes": sum(a > 0 and b == 0 for a, b in pairs),
            "cells_only_baseline_completes": sum(a == 0 and b > 0 for a, b in pairs),
            "cells_latency_better": verdicts.count("avmp better"),
            "cells_latency_tie": verdicts.count("tie"),
            "cells_latency_worse": verdicts.count("avmp worse"),
            "cells_latency_common_better": common.count("avmp better"),
            "cells_latency_common_tie": common.count("tie"),
            "cells_latency_common_worse": common.count("avmp worse"),
            "cells_worse": [
                r["name"] for r in results if r["ci_latency_s"][base]["verdict"] == "avmp worse"
            ],
        }
    return summary


def print_table(results: list[dict], summary: dict, per_cell: bool) -> None:
    cols = (
        "req/s",
        "done",
        "reject",
        "preempt",
        "oom",
        "peak",
        "util",
        "p50us",
        "p99us",
        "p99us n=1",
        "migr",
        "MB moved",
    )
    keys = TABLE_KEYS

    def row(label, m):
        vals = [m[k] / 1e6 if k == "migrated_bytes" else m[k] for k in keys]
        return f"{label:<16}" + "".join(f"{v:>10.3g}" for v in vals)

    header = f"{'policy':<16}" + "".join(f"{c:>10}" for c in cols)
    if per_cell:
        for r in results:
            print(f"\n== {r['name']}  (budget {r['budget_bytes'] / 2**20:.0f} MiB)")
            print(header)
            for p in POLICIES:
                print(row(p, r["policies"][p]))
            print(
                "  avmp vs baseline, mean request latency gain [95% CI] s: "
                + "; ".join(
                    f"{b}: {c['mean_gain']:.3g} [{c['lo']:.3g}, {c['hi']:.3g}] {c['verdict']}"
                    if c["mean_gain"] is not None
                    else f"{b}: n/a"
                    for b, c in r["ci_latency_s"].items()
                )
                + "\n  (requests both completed only: "
                + "; ".join(f"{b}: {c['verdict']}" for b, c in r["ci_latency_common_s"].items())
                + ")"
            )
    print(f"\n== mean over {len(results)} cells")
    print(header)
    for p in POLICIES:
        print(row(p, summary[p]))
    print(
        "alloc latency over all calls of all cells (pooled): "
        + "; ".join(
            f"{p} p50 {summary[p]['alloc_p50_us_pooled']:.3g} us, p99 "
            f"{summary[p]['alloc_p99_us_pooled']:.3g} us, "
            f"{100 * summary[p]['alloc_over_50us_pooled']:.2g}% > 50 us"
            for p in POLICIES
        )
    )
    for base in POLICIES[1:]:
        s = summary[f"avmp_vs_{base}"]
        print(
            f"avmp / {base:<15} throughput x{s['throughput_ratio_geomean']:.3f} "
            f"[{s['ci95'][0]:.3f}, {s['ci95'][1]:.3f}]  latency cells better/tie/worse "
            f"{s['cells_latency_better']}/{s['cells_latency_tie']}/{s['cells_latency_worse']}"
            f"  only-avmp/only-base complete {s['cells_only_avmp_completes']}/"
            f"{s['cells_only_baseline_completes']}"
        )
    t = summary["targets"]
    print(
        f"targets: cells where avmp is worse than some baseline (95%): "
        f"{len(t['cells_avmp_worse_than_some_baseline'])}/{t['cells']}"
        f" {t['cells_avmp_worse_than_some_baseline'][:6]}; better than every baseline: "
        f"{t['cells_avmp_better_than_every_baseline']}/{t['cells']}; shift cells better than "
        f"every baseline {t['shift_cells_avmp_better_than_every_baseline']}/{t['shift_cells']}"
        f", worse than some {t['shift_cells_avmp_worse_than_some_baseline']}"
    )


def write_png(results: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            f"matplotlib is not installed, so no plot was written to {path}; the table and "
            "JSON are complete. Install it with: pip install matplotlib",
            file=sys.stderr,
        )
        return
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for p in POLICIES[1:]:
        # A baseline that completes nothing is drawn at the top of the axis (ratio clipped).
        ratios = sorted(
            min(
                r["policies"]["avmp"]["requests_per_s"]
                / max(r["policies"][p]["requests_per_s"], 1e-12),
                100.0,
            )
            for r in results
        )
        ax.plot(ratios, label=f"avmp / {p}")
    ax.axhline(1.0, color="k", lw=0.5)
    ax.set_yscale("log")
    ax.set_xlabel(f"cell, sorted by ratio ({len(results)} cells)")
    ax.set_ylabel("completed req/s, avmp / baseline")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    print(f"plot written to {path} ({os.path.getsize(path) / 1e3:.0f} kB)")


def bitcast_cost(config: str = "qwen3.5-35b", reps: int = 50, seed: int = 0) -> dict:
    """Cost, on this host's device, of reading state through the arena's bitcast view.

    A decode-like consumer (``out = S^T q`` per layer and head, plus the conv state's
    dot with a kernel) runs jitted on (a) the fields read through :func:`serving.memory.view`
    from the ``uint32`` arena via the handle table, and (b) native arrays of the same shapes
    and dtypes (f32 recurrent state, bf16 conv state). Median of ``reps`` timed calls after
    warm-up, random inputs; results agree to float rounding (XLA may fuse the two
    differently); the ratio (a)/(b) is what the bitcast view costs.
    """
    from jax import numpy as jnp

    from serving.memory import view

    layout = layout_for(CONFIGS[config]["config"], 32, num_layers=4, spec_nodes=8)
    mm = MemoryManager(layout, 4 * layout.state_slot_bytes, "avmp")
    rng = np.random.default_rng(seed)
    fields = {f.name: f for f in layout.fields("state")}
    rec, conv = fields["recurrent"], fields["conv"]
    h = mm.alloc("r", "state", 1)[0]
    native = {
        "recurrent": jnp.asarray(rng.standard_normal(rec.shape, np.float32)),
        "conv": jnp.asarray(rng.standard_normal(conv.shape, np.float32), conv.dtype),
    }
    for name, value in native.items():
        mm.write("state", h, value, field=name)
    q = jnp.asarray(rng.standard_normal(rec.shape[1:3], np.float32))
    w = jnp.asarray(rng.standard_normal(conv.shape[1:], np.float32), conv.dtype)

    def consume(s, c):
        return (
            jnp.einsum("lhkv,hk->lhv", s, q),
            jnp.sum(c.astype(jnp.float32) * w.astype(jnp.float32), axis=1),
        )

    @jax.jit
    def through_view(buf, table, handle):
        return consume(view(buf, table, handle, rec), view(buf, table, handle, conv))

    direct = jax.jit(consume)
    table, handle = mm.device_table(), jnp.int32(h)
    for a, b in zip(
        through_view(mm.arena.buffer, table, handle),
        direct(native["recurrent"], native["conv"]),
        strict=True,
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)

    def median_s(fn, *args):
        jax.block_until_ready(fn(*args))
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    t_view = median_s(through_view, mm.arena.buffer, table, handle)
    t_native = median_s(direct, native["recurrent"], native["conv"])
    return {
        "config": config,
        "device": str(jax.devices()[0]),
        "state_slot_bytes": layout.state_slot_bytes,
        "view_s": t_view,
        "native_s": t_native,
        "ratio_view_over_native": t_view / t_native,
    }


def _progress(done: int, total: int, t0: float) -> None:
    frac = done / total
    eta = (time.perf_counter() - t0) / max(done, 1) * (total - done)
    bar = "#" * int(30 * frac)
    sys.stderr.write(f"\r[{bar:<30}] {done}/{total} cells, eta {eta:5.0f}s")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _run_indexed(args):
    i, cell, preset, seed = args
    return i, run_cell(cell, preset, seed + i)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--preset", choices=sorted(PRESETS), default="smoke")
    ap.add_argument("--json", metavar="PATH", help="write every cell's metrics here")
    ap.add_argument("--png", metavar="PATH", help="plot of AVMP/baseline throughput per cell")
    ap.add_argument(
        "--json-max-bytes",
        type=int,
        default=1 << 20,
        metavar="N",
        help="drop per-request latencies from the JSON when it would exceed N bytes",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--requests", type=int, help="override the preset's requests per cell")
    ap.add_argument("--limit", type=int, help="run only the first LIMIT cells")
    ap.add_argument(
        "--max-prefill-tokens", type=int, default=None, metavar="N",
        help="prompt tokens a step may admit (vLLM's max_num_batched_tokens, SGLang's "
             "max_prefill_tokens; one prompt always fits); default: no limit",
    )  # fmt: skip
    ap.add_argument(
        "--chunked-prefill", type=int, default=None, metavar="N",
        help="tokens a step may process, prompts split into chunks (vLLM V1's "
             "max_num_batched_tokens with chunked prefill, 8192 on H100/H200-class GPUs; "
             "SGLang's chunked_prefill_size): decoding requests' verified nodes first, then "
             "prefill chunks; KV pages are allocated chunk by chunk. Default: off (every "
             "prompt is prefilled in its admission step)",
    )  # fmt: skip
    ap.add_argument(
        "--cell", action="append", metavar="NAME",
        help="re-run this full-grid cell (e.g. qwen3.5-397b/shift/short/bursty/loose/stash; "
             "repeatable) at --seeds seeds instead of the preset: per-seed verdicts and one "
             "paired bootstrap over all seeds' requests",
    )  # fmt: skip
    ap.add_argument("--seeds", type=int, default=10, help="seeds per --cell (default 10)")
    ap.add_argument("--workers", type=int, default=1, help="processes (spawned) for the cells")
    ap.add_argument(
        "--bitcast",
        action="store_true",
        help="only measure the bitcast-view read cost (bitcast_cost) and exit",
    )
    args = ap.parse_args(argv)
    for name in ("max_prefill_tokens", "chunked_prefill", "requests", "limit", "workers",
                 "seeds"):
        v = getattr(args, name)
        if v is not None and v < 1:
            ap.error(f"--{name.replace('_', '-')} must be a positive int, got {v}")
    if args.max_prefill_tokens and args.chunked_prefill:
        ap.error("--max-prefill-tokens and --chunked-prefill are two scheduler models: "
                 "pass one of them")
    if args.bitcast:
        res = bitcast_cost()
        print(json.dumps(res, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
        return res
    preset = dict(PRESETS[args.preset])
    if args.requests:
        preset["requests"] = args.requests
    if args.max_prefill_tokens:
        preset["max_prefill_tokens"] = args.max_prefill_tokens
    if args.chunked_prefill:
        preset["chunked_prefill"] = args.chunked_prefill
    cells = preset.pop("cells")[: args.limit]
    if args.cell:
        if args.png or args.limit:
            ap.error("--png and --limit apply to a preset run, not to --cell")
        grid = {c.name: c for c in PRESETS["full"]["cells"]}
        unknown = [n for n in args.cell if n not in grid]
        if unknown:
            ap.error(f"--cell: not a cell of the full grid: {', '.join(unknown)} (names are "
                     "config/prompt/output/arrival/budget/spec, e.g. "
                     f"{PRESETS['full']['cells'][0].name})")
        full = {k: v for k, v in PRESETS["full"].items() if k != "cells"}  # --preset aside
        for key in ("max_prefill_tokens", "chunked_prefill", "requests"):
            if getattr(args, key):
                full[key] = getattr(args, key)
        t0 = time.perf_counter()
        sweep = seed_sweep([grid[n] for n in args.cell], full, args.seeds, args.seed)
        print_sweep(sweep, args.seeds)
        print(f"\n{len(args.cell)} cell(s) x {args.seeds} seeds in {time.perf_counter() - t0:.1f}s")
        report = {"cells": args.cell, "seeds": args.seeds, "seed": args.seed,
                  "preset_params": full, "policy_args": POLICY_ARGS, "sweep": sweep}  # fmt: skip
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
        return report
    t0 = time.perf_counter()
    results: list[dict | None] = [None] * len(cells)
    jobs = [(i, c, preset, args.seed) for i, c in enumerate(cells)]
    if args.workers > 1:
        import concurrent.futures
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(args.workers, mp_context=ctx) as ex:
            for k, (i, res) in enumerate(ex.map(_run_indexed, jobs)):
                results[i] = res
                _progress(k + 1, len(cells), t0)
    else:
        for k, job in enumerate(jobs):
            i, results[i] = _run_indexed(job)
            _progress(k + 1, len(cells), t0)
    summary = summarise(results, args.seed)
    for r in results:  # the histograms only feed the pooled percentiles of the summary
        for m in r["policies"].values():
            m.pop("_alloc_hist", None)
    print_table(results, summary, per_cell=len(results) <= 8)
    print(
        f"\n{len(cells)} cells x {len(POLICIES)} policies in {time.perf_counter() - t0:.1f}s "
        f"on {jax.devices()[0].platform}"
    )
    report = {
        "preset": args.preset,
        "preset_params": {k: v for k, v in preset.items()},
        "seed": args.seed,
        "policy_args": POLICY_ARGS,
        "configs": CONFIGS,
        "jax": jax.__version__,
        "device": str(jax.devices()[0]),
        "host": platform.platform(),
        "cpus": os.cpu_count(),
        "summary": summary,
        "cells": results,
    }
    if args.json:
        text = json.dumps(report, indent=1)
        if len(text) > args.json_max_bytes:
            slim = dict(
                report,
                per_request_latencies="dropped (--json-max-bytes)",
                cells=[
                    {k: v for k, v in c.items() if k != "policies"}
                    | {
                        "policies": {
                            p: {k: v for k, v in m.items() if k != "latency_s"}
                            for p, m in c["policies"].items()
                        }
                    }
                    for c in results
                ],
            )
            text = json.dumps(slim, separators=(",", ":"))
        with open(args.json, "w") as f:
            f.write(text)
    if args.png:
        write_png(results, args.png)
    return report


if __name__ == "__main__":
    main()
