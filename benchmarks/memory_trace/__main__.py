"""Command line of the memory study (``python -m benchmarks.memory_trace --help``): a preset
of cells (tables, JSON, PNG), or a seed sweep of named cells of the full grid."""

from __future__ import annotations

import argparse
import os
import platform
import time

import jax

from benchmarks.memory_trace import report
from benchmarks.memory_trace.scheduler import RESERVE_TOKENS
from benchmarks.memory_trace.stats import summarise
from benchmarks.memory_trace.study import run_indexed, seed_sweep
from benchmarks.memory_trace.workload import CONFIGS, POLICIES, POLICY_ARGS, PRESETS

_DESCRIPTION = f"""\
Trace replay of serving.memory.MemoryManager: AVMP against the unified_padded, static_dual and
multi_ended baselines, at the same byte budget on the same requests, over a grid of cells
(config x prompt x output x arrival x budget x speculative scratch), under a simulated
scheduler (each step the running requests verify, grow their KV pages and are preempted on
OOM; admission keeps room for the batch's next scratch and {RESERVE_TOKENS} tokens of KV growth
per request). Prints a table per cell (up to 8 cells), the means over cells, and AVMP's
throughput ratio and latency verdicts (95% paired bootstrap) against each baseline.
See benchmarks/memory_trace/README.md."""
_EXAMPLES = """examples:
  python -m benchmarks.memory_trace --preset smoke
  python -m benchmarks.memory_trace --preset full --workers 2 --json out.json --png out.png
  python -m benchmarks.memory_trace --preset full --workers 2 --chunked-prefill 512
  python -m benchmarks.memory_trace --preset full --workers 2 --max-prefill-tokens 2048
  python -m benchmarks.memory_trace --cell qwen3.5-397b/shift/short/bursty/loose/stash \\
      --seeds 20 --chunked-prefill 512

--preset smoke (4 cells, 24 requests each) takes seconds on a CPU; --preset full (336 cells,
64 requests each) about 6 minutes on 2 cores with --workers 2."""
# Options that must be positive when given.
_POSITIVE = ("max_prefill_tokens", "chunked_prefill", "requests", "limit", "workers", "seeds")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.memory_trace",
        description=_DESCRIPTION,
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="smoke",
        help="cells and requests per cell to run (default: smoke)",
    )
    ap.add_argument("--json", metavar="PATH", help="write every cell's metrics here")
    ap.add_argument("--png", metavar="PATH", help="plot of AVMP/baseline throughput per cell")
    ap.add_argument(
        "--json-max-bytes",
        type=int,
        default=1 << 20,
        metavar="N",
        help="drop per-request latencies from the JSON when it would exceed N bytes",
    )
    ap.add_argument(
        "--seed", type=int, default=0, help="seed of the first cell; cell i uses seed + i"
    )
    ap.add_argument("--requests", type=int, help="override the preset's requests per cell")
    ap.add_argument("--limit", type=int, help="run only the first LIMIT cells")
    ap.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=None,
        metavar="N",
        help="prompt tokens a step may admit (vLLM's max_num_batched_tokens, SGLang's "
        "max_prefill_tokens; one prompt always fits); default: no limit",
    )
    ap.add_argument(
        "--chunked-prefill",
        type=int,
        default=None,
        metavar="N",
        help="tokens a step may process, prompts split into chunks (vLLM V1's "
        "max_num_batched_tokens with chunked prefill, 8192 on H100/H200-class GPUs; "
        "SGLang's chunked_prefill_size): decoding requests' verified nodes first, then "
        "prefill chunks; KV pages are allocated chunk by chunk. Default: off (every "
        "prompt is prefilled in its admission step)",
    )
    ap.add_argument(
        "--cell",
        action="append",
        metavar="NAME",
        help="re-run this full-grid cell (e.g. qwen3.5-397b/shift/short/bursty/loose/stash; "
        "repeatable) at --seeds seeds instead of the preset: per-seed verdicts and one "
        "paired bootstrap over all seeds' requests",
    )
    ap.add_argument("--seeds", type=int, default=10, help="seeds per --cell (default 10)")
    ap.add_argument("--workers", type=int, default=1, help="processes (spawned) for the cells")
    return ap


def _run_sweep(ap: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    if args.png or args.limit:
        ap.error("--png and --limit apply to a preset run, not to --cell")
    grid = {c.name: c for c in PRESETS["full"]["cells"]}
    unknown = [n for n in args.cell if n not in grid]
    if unknown:
        ap.error(
            f"--cell: not a cell of the full grid: {', '.join(unknown)} (names are "
            "config/prompt/output/arrival/budget/spec, e.g. "
            f"{PRESETS['full']['cells'][0].name})"
        )
    full = {k: v for k, v in PRESETS["full"].items() if k != "cells"}  # --preset aside
    for key in ("max_prefill_tokens", "chunked_prefill", "requests"):
        if getattr(args, key):
            full[key] = getattr(args, key)
    t0 = time.perf_counter()
    sweep = seed_sweep([grid[n] for n in args.cell], full, args.seeds, args.seed)
    report.print_sweep(sweep, args.seeds)
    print(f"\n{len(args.cell)} cell(s) x {args.seeds} seeds in {time.perf_counter() - t0:.1f}s")
    out = {
        "cells": args.cell,
        "seeds": args.seeds,
        "seed": args.seed,
        "preset_params": full,
        "policy_args": POLICY_ARGS,
        "sweep": sweep,
    }
    if args.json:
        report.write_json(out, args.json)
    return out


def _run_cells(jobs: list, workers: int) -> list[dict]:
    t0 = time.perf_counter()
    results: list = [None] * len(jobs)
    if workers > 1:
        import concurrent.futures
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as ex:
            for k, (i, res) in enumerate(ex.map(run_indexed, jobs)):
                results[i] = res
                report.progress(k + 1, len(jobs), t0)
    else:
        for k, job in enumerate(jobs):
            i, results[i] = run_indexed(job)
            report.progress(k + 1, len(jobs), t0)
    return results


def main(argv: list[str] | None = None) -> dict:
    """Run the command line ``argv``; returns the report that ``--json`` writes."""
    ap = _parser()
    args = ap.parse_args(argv)
    for name in _POSITIVE:
        v = getattr(args, name)
        if v is not None and v < 1:
            ap.error(f"--{name.replace('_', '-')} must be a positive int, got {v}")
    if args.max_prefill_tokens and args.chunked_prefill:
        ap.error(
            "--max-prefill-tokens and --chunked-prefill are two scheduler models: pass one of them"
        )
    if args.cell:
        return _run_sweep(ap, args)
    preset = dict(PRESETS[args.preset])
    if args.requests:
        preset["requests"] = args.requests
    if args.max_prefill_tokens:
        preset["max_prefill_tokens"] = args.max_prefill_tokens
    if args.chunked_prefill:
        preset["chunked_prefill"] = args.chunked_prefill
    cells = preset.pop("cells")[: args.limit]
    t0 = time.perf_counter()
    results = _run_cells([(i, c, preset, args.seed) for i, c in enumerate(cells)], args.workers)
    summary = summarise(results, args.seed)
    for r in results:  # the histograms only feed the pooled percentiles of the summary
        for m in r["policies"].values():
            m.pop("_alloc_hist", None)
    report.print_table(results, summary, per_cell=len(results) <= 8)
    print(
        f"\n{len(cells)} cells x {len(POLICIES)} policies in {time.perf_counter() - t0:.1f}s "
        f"on {jax.devices()[0].platform}"
    )
    out = {
        "preset": args.preset,
        "preset_params": preset,
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
        report.write_json(out, args.json, args.json_max_bytes)
    if args.png:
        report.write_png(results, args.png)
    return out


if __name__ == "__main__":
    main()
