"""Statistics of the study: the paired bootstrap of request latencies, AVMP's verdict against
a baseline, and the summary over the cells of a run.

A verdict compares AVMP with a baseline on the same requests of one cell: the 95% interval of
the mean latency gain (baseline minus AVMP) from a paired bootstrap over requests; "avmp
better" when it lies above zero, "avmp worse" below, "tie" otherwise. The primary comparison
censors a rejected request (see :func:`latencies`); the comparison over the requests both
policies completed is reported beside it.
"""

from __future__ import annotations

import math

import numpy as np

from benchmarks.memory_trace.scheduler import LAT_BINS_US
from benchmarks.memory_trace.workload import POLICIES

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


def paired_bootstrap(a: np.ndarray, b: np.ndarray, rng, reps: int = 2000):
    """``(mean, lo, hi)``: mean(b - a) and its 95% interval over the requests both have a
    latency for (positive: ``a`` is faster); ``None`` when there is no such request."""
    ok = ~(np.isnan(a) | np.isnan(b))
    d = (b - a)[ok]
    if d.size == 0:
        return None
    means = d[rng.integers(0, d.size, (reps, d.size))].mean(axis=1)
    return float(d.mean()), float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def verdict(ci) -> str:
    """AVMP's verdict from a :func:`paired_bootstrap` of (AVMP, baseline) latencies."""
    if ci is None:
        return "n/a"
    return "avmp better" if ci[1] > 0 else "avmp worse" if ci[2] < 0 else "tie"


def latencies(policies: dict, arrival: np.ndarray) -> tuple[dict, dict]:
    """Per-policy request latencies of one cell's runs (NaN: not completed), and the same
    censored for the primary comparison.

    A rejected request (it could not run even alone under that policy) never gets an answer.
    Comparing only the requests both policies completed would reward rejecting the big ones
    (less queueing for the rest), so the primary comparison censors a rejected request's
    latency at the cell's horizon (the latest makespan of any policy), the same horizon for
    every policy: a lower bound on what the rejection cost its user. Requests no policy
    completed are left out.
    """
    lat = {
        p: np.array([np.nan if x is None else x for x in m["latency_s"]])
        for p, m in policies.items()
    }
    horizon = max(m["makespan_s"] for m in policies.values())
    served = ~np.all(np.isnan(np.stack(list(lat.values()))), axis=0)
    censored = {p: np.where(np.isnan(x), horizon - arrival, x)[served] for p, x in lat.items()}
    return lat, censored


def compare(policies: dict, arrival: np.ndarray, seed: int) -> dict:
    """AVMP against each baseline in one cell: ``ci_latency_s`` (censored) and
    ``ci_latency_common_s`` (requests both completed), each ``{baseline: {mean_gain, lo, hi,
    verdict}}``."""
    rng = np.random.default_rng(seed)
    lat, censored = latencies(policies, arrival)
    out = {"ci_latency_s": {}, "ci_latency_common_s": {}}
    for base in POLICIES[1:]:
        for key, arrays in (("ci_latency_s", censored), ("ci_latency_common_s", lat)):
            ci = paired_bootstrap(arrays["avmp"], arrays[base], rng)
            out[key][base] = {
                "mean_gain": ci and ci[0],
                "lo": ci and ci[1],
                "hi": ci and ci[2],
                "verdict": verdict(ci),
            }
    return out


def _pooled_alloc(rows: list[dict]) -> dict:
    """Allocation latency over every call of every cell, from the per-run histograms (a
    percentile is the upper edge of the bin that holds it: ~2% resolution)."""
    hist = np.sum([x["_alloc_hist"] for x in rows], axis=0)
    cum = np.cumsum(hist) / hist.sum()
    out = {
        f"alloc_p{q}_us_pooled": float(LAT_BINS_US[1:][np.searchsorted(cum, q / 100)])
        for q in (50, 99)
    }
    out["alloc_calls"] = int(hist.sum())
    out["alloc_over_50us_pooled"] = float(hist[LAT_BINS_US[:-1] >= 50].sum() / hist.sum())
    return out


def _worse_than_some(r: dict) -> bool:
    return any(r["ci_latency_s"][b]["verdict"] == "avmp worse" for b in POLICIES[1:])


def _better_than_every(r: dict) -> bool:
    return all(r["ci_latency_s"][b]["verdict"] == "avmp better" for b in POLICIES[1:])


def _ratio_to_best(r: dict) -> float:
    best = max(r["policies"][b]["requests_per_s"] for b in POLICIES[1:])
    return r["policies"]["avmp"]["requests_per_s"] / best if best > 0 else math.inf


def _geomean(xs) -> float:
    return math.exp(np.mean([math.log(x) for x in xs]))


def summarise(results: list[dict], seed: int) -> dict:
    """Across the cells of a run: per policy, the means of the metrics and the pooled
    allocation latency; the targets (cells where AVMP is worse than some baseline, better
    than every one, the same over the shift cells); per baseline, AVMP's throughput ratio
    (geometric mean over cells, 95% interval from a bootstrap over cells) and the counts of
    latency verdicts."""
    rng = np.random.default_rng(seed)
    summary = {}
    for p in POLICIES:
        rows = [r["policies"][p] for r in results]
        summary[p] = {
            k: float(np.mean([x[k] for x in rows]))
            for k in (*TABLE_KEYS, "host_step_s", "manager_device_s")
        }
        summary[p]["alloc_p99_us_max"] = float(max(x["alloc_p99_us"] for x in rows))
        summary[p].update(_pooled_alloc(rows))

    shift = [r for r in results if r["cell"]["prompt"] == "shift"]
    shift_ratios = [x for x in map(_ratio_to_best, shift) if 0 < x < math.inf]
    summary["targets"] = {
        "cells": len(results),
        "cells_avmp_worse_than_some_baseline": [r["name"] for r in results if _worse_than_some(r)],
        "cells_avmp_better_than_every_baseline": sum(map(_better_than_every, results)),
        "shift_cells": len(shift),
        "shift_cells_avmp_better_than_every_baseline": sum(map(_better_than_every, shift)),
        "shift_cells_avmp_worse_than_some_baseline": sum(map(_worse_than_some, shift)),
        "shift_throughput_vs_best_baseline_geomean": _geomean(shift_ratios) if shift else None,
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
