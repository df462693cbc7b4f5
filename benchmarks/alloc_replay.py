"""Replay recorded allocator call sequences of the slowest study cells (alloc p99).

    python -m benchmarks.alloc_replay                          # record + replay, table
    python -m benchmarks.alloc_replay --replays 10 --json out.json
    python -m benchmarks.alloc_replay --save-traces t.json     # keep the recorded calls
    python -m benchmarks.alloc_replay --traces t.json          # replay (and check) saved calls

Recording: each cell runs once under ``benchmarks.memory_trace``'s scheduler (same requests,
seeds and budgets as the full preset: the seed of a cell is its index in the full grid) with
the manager wrapped so that every ``alloc``, ``free``, ``fits`` and ``fits_all`` call and its
result (handles, or the error's class) is recorded, plus ``stats()`` and a digest of the host
layout (owner, live units and rank of every segment, slot of every handle) at the end.

Replay: a fresh manager per replay runs exactly the recorded calls; every result is checked
against the recording (any difference is an error: the layout must be bit-for-bit the same),
and each ``alloc`` call is timed (``perf_counter_ns``). The table gives, per cell, the p50 and
p99 over calls of each call's **minimum over the replays** (this shared host's load is noise,
the minimum filters it), the share of calls over 50 us, and the same for multi-unit calls
only. ``--traces`` with a file saved by an older revision of the manager is the identity check
between revisions.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import sys
import time
import types

import numpy as np

from benchmarks.memory_trace.scheduler import Sim
from benchmarks.memory_trace.workload import (
    CONFIGS,
    POLICIES,
    POLICY_ARGS,
    PRESETS,
    Cell,
    make_requests,
)
from serving.memory import AllocationTooLargeError, MemoryManager, OutOfMemoryError, layout_for

# The AVMP cells with the highest per-cell alloc p99 of the full study
# (benchmarks/results/memory_trace/default.json): tiny-model snapshot cells (8-slot allocations
# that acquire one-slot segments) and long-prompt Qwen cells (multi-segment KV allocations).
DEFAULT_CELLS = (
    "tiny/shift/short/batch/tight/snapshot",
    "tiny/short/short/batch/tight/snapshot",
    "tiny/shift/long/batch/loose/snapshot",
    "tiny/short/short/poisson/loose/snapshot",
    "tiny/long/short/bursty/loose/snapshot",
    "qwen3.5-35b/shift/short/poisson/loose/stash",
    "qwen3.5-397b/shift/short/batch/tight/stash",
    "qwen3.5-397b/long/mixed/batch/tight/stash",
)
_ERRORS = (OutOfMemoryError, AllocationTooLargeError)


# The manager's modules, in import order (a revision without some of them skips those).
_BASELINE_MODULES = (
    "pools",
    "segments",
    "policies",
    "handles",
    "migration",
    "allocator",
    "manager",
)


def load_baseline(path: str) -> type:
    """The ``MemoryManager`` class of another revision: ``path`` holds copies of its
    ``serving/memory/{pools,segments,policies,handles,migration,allocator,manager}.py`` (those
    it has). They are loaded under a private package name (their imports of each other
    rewritten to it); layout, arena and errors are shared with the current tree, so both raise
    the same exceptions."""
    pkg = types.ModuleType("_baseline_memory")
    pkg.__path__ = []
    sys.modules[pkg.__name__] = pkg
    for name in _BASELINE_MODULES:
        if not os.path.exists(os.path.join(path, f"{name}.py")):
            continue
        with open(os.path.join(path, f"{name}.py")) as f:
            src = f.read()
        for other in _BASELINE_MODULES:
            src = src.replace(f"serving.memory.{other}", f"_baseline_memory.{other}")
        mod = types.ModuleType(f"_baseline_memory.{name}")
        mod.__file__ = os.path.join(path, f"{name}.py")
        sys.modules[mod.__name__] = mod
        exec(compile(src, mod.__file__, "exec"), mod.__dict__)
        setattr(pkg, name, mod)
    return pkg.manager.MemoryManager


def _full_index() -> dict[str, int]:
    return {c.name: i for i, c in enumerate(PRESETS["full"]["cells"])}


def _setup(name: str, policy: str):
    cell = Cell(*name.split("/"))
    preset = PRESETS["full"]
    spec = CONFIGS[cell.config]
    layout = layout_for(
        spec["config"], preset["page_size"], num_layers=4, spec_nodes=preset["spec_nodes"]
    )
    budget = preset["budgets"][cell.budget] * layout.state_slot_bytes
    return cell, preset, spec, layout, budget


def layout_digest(mm: MemoryManager) -> str:
    """Hash of the host layout: owner, live units, rank of every segment; slot and owner of
    every handle; the free-handle stack; every pool's owned/empty sets and counters."""
    state = [
        mm.seg_owner,
        mm.seg_live,
        mm.seg_rank,
        mm._h_slot,
        [None if o is None else [str(o[0]), o[1]] for o in mm._h_owner],
        mm._free_handles,
        [sorted(s) for s in mm.seg_free],
        [[p.name, sorted(p.owned), sorted(p.empty), p.live, p.free_units] for p in mm.pools],
        mm.unowned,
    ]
    return hashlib.sha256(json.dumps(state).encode()).hexdigest()


def _stats(mm: MemoryManager) -> dict:
    return json.loads(json.dumps(mm.stats()))


class _Recorder:
    """Wraps a manager; records every allocator call and its result."""

    def __init__(self, mm: MemoryManager):
        self._mm, self.ops = mm, []

    def __getattr__(self, name):
        return getattr(self._mm, name)

    def alloc(self, rid, kind, n=1):
        try:
            out = self._mm.alloc(rid, kind, n)
        except _ERRORS as e:
            self.ops.append(["alloc", int(rid), kind, int(n), type(e).__name__])
            raise
        self.ops.append(["alloc", int(rid), kind, int(n), list(out)])
        return out

    def free(self, rid, kind=None, handles=None):
        self._mm.free(rid, kind, handles)
        self.ops.append(["free", int(rid), kind, None if handles is None else list(handles)])

    def fits(self, kind, n=1):
        ok = self._mm.fits(kind, n)
        self.ops.append(["fits", kind, int(n), ok])
        return ok

    def fits_all(self, needs):
        needs = [(k, int(n)) for k, n in needs]
        ok = self._mm.fits_all(needs)
        self.ops.append(["fits_all", [list(x) for x in needs], ok])
        return ok


def record(name: str, policy: str = "avmp") -> dict:
    """Run one cell of the study for ``policy``, recording the manager calls."""
    cell, preset, spec, layout, budget = _setup(name, policy)
    seed = _full_index()[name]
    req = make_requests(cell, preset["requests"], seed, spec["cost"][0])
    sim = Sim(layout, budget, policy, cell, spec["cost"])
    rec = sim.mm = _Recorder(sim.mm)
    metrics = sim.run(req)
    mm = rec._mm
    return {
        "cell": name,
        "policy": policy,
        "ops": rec.ops,
        "stats": _stats(mm),
        "digest": layout_digest(mm),
        "sim": {
            k: metrics[k]
            for k in (
                "makespan_s",
                "completed",
                "preemptions",
                "migrations",
                "migrated_bytes",
                "compactions",
            )
        },
    }


def replay(
    trace: dict, check: bool = True, cls: type = MemoryManager
) -> tuple[list[int], list[int]]:
    """One replay on a fresh manager of class ``cls``: (ns per alloc call, n per alloc call).
    Raises AssertionError on the first result that differs from the recording."""
    _, _, _, layout, budget = _setup(trace["cell"], trace["policy"])
    mm = cls(layout, budget, trace["policy"], **POLICY_ARGS.get(trace["policy"], {}))
    mm.arena.buffer.block_until_ready()  # the arena's zero fill must not overlap the timing
    clock = time.perf_counter_ns
    alloc, free, fits_all, fits = mm.alloc, mm.free, mm.fits_all, mm.fits
    lat, ns = [], []
    for i, op in enumerate(trace["ops"]):
        what = op[0]
        if what == "alloc":
            _, rid, kind, n, want = op
            t0 = clock()
            try:
                got = alloc(rid, kind, n)
            except _ERRORS as e:
                got = type(e).__name__
            lat.append(clock() - t0)
            ns.append(n)
        elif what == "free":
            free(op[1], op[2], op[3])
            continue
        elif what == "fits_all":
            got, want = fits_all([tuple(x) for x in op[1]]), op[2]
        else:
            got, want = fits(op[1], op[2]), op[3]
        if check and got != want:
            raise AssertionError(f"{trace['cell']}: call {i} {op[:4]} gave {got}, recorded {want}")
    if check:
        if _stats(mm) != trace["stats"]:
            raise AssertionError(f"{trace['cell']}: stats differ: {_stats(mm)} vs {trace['stats']}")
        if layout_digest(mm) != trace["digest"]:
            raise AssertionError(f"{trace['cell']}: layout digest differs")
    return lat, ns


def summarise(trace: dict, runs: list[list[int]], ns: list[int]) -> dict:
    best = np.min(np.asarray(runs), axis=0) / 1e3  # us, min over replays per call
    n = np.asarray(ns)
    multi = best[n > 1]
    row = {
        "cell": trace["cell"],
        "policy": trace["policy"],
        "calls": int(best.size),
        "multi_calls": int(multi.size),
        "p50_us": float(np.percentile(best, 50)),
        "p99_us": float(np.percentile(best, 99)),
        "max_us": float(best.max()),
        "over_50us": float(np.mean(best > 50)),
        "multi_p50_us": float(np.percentile(multi, 50)) if multi.size else None,
        "multi_p99_us": float(np.percentile(multi, 99)) if multi.size else None,
        "sum_ms": float(best.sum() / 1e3),
    }
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--cells",
        nargs="+",
        default=list(DEFAULT_CELLS),
        metavar="CELL",
        help="full-preset cell names (config/prompt/output/arrival/budget/spec)",
    )
    ap.add_argument("--policy", default="avmp", choices=POLICIES)
    ap.add_argument(
        "--replays",
        type=int,
        default=7,
        help="timed replays per cell (min is kept); 0: only the checked warm-up",
    )
    ap.add_argument(
        "--traces",
        metavar="PATH",
        help="replay the traces saved in PATH "
        "(checking every result against them) instead of recording",
    )
    ap.add_argument("--save-traces", metavar="PATH", help="write the recorded traces here")
    ap.add_argument(
        "--baseline",
        metavar="DIR",
        help="also replay the MemoryManager of another revision, interleaved with the current "
        "one: DIR holds its serving/memory/{pools,policies,manager}.py and, where it has them, "
        "{segments,handles,migration,allocator}.py",
    )
    ap.add_argument("--no-check", action="store_true", help="do not compare results")
    ap.add_argument("--json", metavar="PATH", help="write the table rows here")
    args = ap.parse_args(argv)

    if args.traces:
        with open(args.traces) as f:
            traces = json.load(f)
    else:
        traces = []
        for name in args.cells:
            t0 = time.perf_counter()
            traces.append(record(name, args.policy))
            print(
                f"recorded {name}: {len(traces[-1]['ops'])} calls "
                f"({time.perf_counter() - t0:.1f}s)",
                file=sys.stderr,
            )
        if args.save_traces:
            with open(args.save_traces, "w") as f:
                json.dump(traces, f, separators=(",", ":"))
    impls = {"current": MemoryManager}
    if args.baseline:
        impls = {"baseline": load_baseline(args.baseline), **impls}
    check = not args.no_check
    rows = []
    for trace in traces:
        runs: dict[str, list[list[int]]] = {k: [] for k in impls}
        for cls in impls.values():
            replay(trace, check, cls)  # warm-up (jit compiles of the copy kernels) and check
        for _ in range(args.replays):
            for name, cls in impls.items():  # interleaved: both see the same host load
                gc.collect()
                lat, ns = replay(trace, check, cls)
                runs[name].append(lat)
        if args.replays:
            rows += [dict(summarise(trace, r, ns), impl=k) for k, r in runs.items()]
    verdict = "NOT checked" if args.no_check else "identical to the recording"
    if not rows:
        print(
            f"{len(traces)} traces x {len(impls)} implementation(s) replayed once; "
            f"every result {verdict}"
        )
        return {"replays": 0, "checked": check, "rows": []}
    head = (
        "cell",
        "impl",
        "calls",
        "p50 us",
        "p99 us",
        "max us",
        "% >50us",
        "multi p50",
        "multi p99",
        "sum ms",
    )
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        mp50 = "-" if r["multi_p50_us"] is None else f"{r['multi_p50_us']:.1f}"
        mp99 = "-" if r["multi_p99_us"] is None else f"{r['multi_p99_us']:.1f}"
        print(
            f"| {r['cell']} | {r['impl']} | {r['calls']} | {r['p50_us']:.2f} | "
            f"{r['p99_us']:.1f} | {r['max_us']:.1f} | {100 * r['over_50us']:.2f} | {mp50} | "
            f"{mp99} | {r['sum_ms']:.1f} |"
        )
    summary = {}
    for k in impls:
        mine = [r for r in rows if r["impl"] == k]
        summary[k] = {
            "cells": len(mine),
            "max_p99_us": max(r["p99_us"] for r in mine),
            "mean_p99_us": float(np.mean([r["p99_us"] for r in mine])),
            "mean_multi_p99_us": float(np.mean([r["multi_p99_us"] or 0 for r in mine])),
            "cells_p99_over_50us": sum(r["p99_us"] > 50 for r in mine),
            "calls_over_50us": float(
                sum(r["over_50us"] * r["calls"] for r in mine) / sum(r["calls"] for r in mine)
            ),
            "sum_ms": float(sum(r["sum_ms"] for r in mine)),
        }
        v = summary[k]
        print(
            f"\n{k}: {v['cells']} cells, {args.replays} replays (min per call); p99 max "
            f"{v['max_p99_us']:.1f} us, mean {v['mean_p99_us']:.1f} us; multi-unit p99 mean "
            f"{v['mean_multi_p99_us']:.1f} us; cells with p99 > 50 us: "
            f"{v['cells_p99_over_50us']}; calls > 50 us: {100 * v['calls_over_50us']:.3f}%; "
            f"total {v['sum_ms']:.1f} ms"
        )
    print(f"every result {verdict}")
    report = {"replays": args.replays, "checked": check, "rows": rows, "summary": summary}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
