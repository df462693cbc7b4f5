"""Output of a run: the tables on stdout, the JSON report and the PNG plot."""

from __future__ import annotations

import json
import os
import sys
import time

from benchmarks.memory_trace.stats import TABLE_KEYS
from benchmarks.memory_trace.workload import POLICIES

# Column headers of TABLE_KEYS, in the same order.
_COLUMNS = (
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


def _row(label: str, m: dict) -> str:
    vals = [m[k] / 1e6 if k == "migrated_bytes" else m[k] for k in TABLE_KEYS]
    return f"{label:<16}" + "".join(f"{v:>10.3g}" for v in vals)


def _gain(base: str, c: dict) -> str:
    if c["mean_gain"] is None:
        return f"{base}: n/a"
    return f"{base}: {c['mean_gain']:.3g} [{c['lo']:.3g}, {c['hi']:.3g}] {c['verdict']}"


def print_table(results: list[dict], summary: dict, per_cell: bool) -> None:
    """The per-policy metrics (per cell when ``per_cell``, then the mean over cells), pooled
    allocation latency, AVMP's throughput ratio and latency verdicts against each baseline,
    and the targets."""
    header = f"{'policy':<16}" + "".join(f"{c:>10}" for c in _COLUMNS)
    if per_cell:
        for r in results:
            print(f"\n== {r['name']}  (budget {r['budget_bytes'] / 2**20:.0f} MiB)")
            print(header)
            for p in POLICIES:
                print(_row(p, r["policies"][p]))
            gains = "; ".join(_gain(b, c) for b, c in r["ci_latency_s"].items())
            common = "; ".join(f"{b}: {c['verdict']}" for b, c in r["ci_latency_common_s"].items())
            print(f"  avmp vs baseline, mean request latency gain [95% CI] s: {gains}")
            print(f"  (requests both completed only: {common})")
    print(f"\n== mean over {len(results)} cells")
    print(header)
    for p in POLICIES:
        print(_row(p, summary[p]))
    pooled = "; ".join(
        f"{p} p50 {summary[p]['alloc_p50_us_pooled']:.3g} us, p99 "
        f"{summary[p]['alloc_p99_us_pooled']:.3g} us, "
        f"{100 * summary[p]['alloc_over_50us_pooled']:.2g}% > 50 us"
        for p in POLICIES
    )
    print(f"alloc latency over all calls of all cells (pooled): {pooled}")
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
    worse = t["cells_avmp_worse_than_some_baseline"]
    print(
        f"targets: cells where avmp is worse than some baseline (95%): "
        f"{len(worse)}/{t['cells']} {worse[:6]}; better than every baseline: "
        f"{t['cells_avmp_better_than_every_baseline']}/{t['cells']}; shift cells better than "
        f"every baseline {t['shift_cells_avmp_better_than_every_baseline']}/{t['shift_cells']}"
        f", worse than some {t['shift_cells_avmp_worse_than_some_baseline']}"
    )


def print_sweep(sweep: dict, seeds: int) -> None:
    """A seed sweep (:func:`~benchmarks.memory_trace.study.seed_sweep`) as a Markdown table."""
    print(
        f"| cell | vs | seeds better / tie / worse (of {seeds}) | seeds with mean gain < 0 "
        "| pooled mean latency gain s [95% CI] | throughput ratio (geomean) |"
    )
    print("|---|---|---|---|---|---|")
    for name, res in sweep.items():
        for b, v in res["vs"].items():
            print(
                f"| {name} | {b} | {v['seeds_better']} / {v['seeds_tie']} / "
                f"{v['seeds_worse']} | {v['seeds_mean_gain_negative']} | "
                f"{v['pooled_mean_gain_s']:+.3f} [{v['pooled_lo']:+.3f}, "
                f"{v['pooled_hi']:+.3f}] | {v['throughput_ratio_geomean']:.3f} |"
            )


def write_json(report: dict, path: str, max_bytes: int | None = None) -> None:
    """``report`` as indented JSON; above ``max_bytes``, a preset run's report without the
    per-request latencies (``latency_s`` of every policy of every cell) and compact."""
    text = json.dumps(report, indent=1)
    if max_bytes is not None and len(text) > max_bytes:
        cells = [
            {k: v for k, v in c.items() if k != "policies"}
            | {
                "policies": {
                    p: {k: v for k, v in m.items() if k != "latency_s"}
                    for p, m in c["policies"].items()
                }
            }
            for c in report["cells"]
        ]
        slim = dict(report, per_request_latencies="dropped (--json-max-bytes)", cells=cells)
        text = json.dumps(slim, separators=(",", ":"))
    with open(path, "w") as f:
        f.write(text)


def write_png(results: list[dict], path: str) -> None:
    """AVMP's completed requests/s over each baseline's, per cell, sorted (log scale)."""
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


def progress(done: int, total: int, t0: float) -> None:
    """A progress bar with an estimate of the time left, on stderr."""
    frac = done / total
    eta = (time.perf_counter() - t0) / max(done, 1) * (total - done)
    bar = "#" * int(30 * frac)
    sys.stderr.write(f"\r[{bar:<30}] {done}/{total} cells, eta {eta:5.0f}s")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()
