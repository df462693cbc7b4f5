"""Tables and plots of a run (or of several runs' JSON merged). Plots need matplotlib (the
``bench`` extra); without it they are skipped with a note."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from benchmarks.common import fmt_bytes, markdown_table

COLUMNS = [
    ("workload", "workload"),
    ("method", "method"),
    ("nodes", "N"),
    ("rate", "rate (req/s)"),
    ("requests", "requests"),
    ("request_throughput", "req/s"),
    ("token_throughput", "tok/s"),
    ("ttft_p50_ms", "TTFT p50 ms"),
    ("ttft_p99_ms", "TTFT p99 ms"),
    ("tpot_p50_ms", "TPOT p50 ms"),
    ("tpot_p99_ms", "TPOT p99 ms"),
    ("mean_acceptance_length", "accept len"),
    ("peak_concurrency", "peak running"),
    ("preemptions", "preemptions"),
    ("spec_mem", "spec mem / req"),
    ("peak_spec_mem", "peak spec mem"),
    ("peak_kv_mem", "peak KV mem"),
    ("same_tokens_as_plain", "same tokens"),
]

POLICY_COLUMNS = [
    ("policy", "policy"),
    ("repeat", "repeat"),
    ("request_throughput", "req/s"),
    ("ttft_p50_ms", "TTFT p50 ms"),
    ("ttft_p99_ms", "TTFT p99 ms"),
    ("preemptions", "preemptions"),
    ("rejected", "rejected"),
    ("migrations", "migrations"),
    ("migrated_mem", "migrated"),
    ("compactions", "compactions"),
    ("steps", "steps"),
    ("ms_per_step", "ms / step"),
]


def _display(row: dict) -> dict:
    out = dict(row)
    out["spec_mem"] = fmt_bytes(row.get("spec_bytes_per_request", 0))
    out["peak_spec_mem"] = fmt_bytes(row.get("peak_spec_bytes", 0))
    out["peak_kv_mem"] = fmt_bytes(row.get("peak_kv_bytes", 0))
    out["migrated_mem"] = fmt_bytes(row.get("migrated_bytes", 0))
    if row.get("steps"):
        out["ms_per_step"] = round(1e3 * row["busy_s"] / row["steps"], 1)
    out.setdefault("repeat", 0)
    return out


def tables(doc: dict) -> str:
    parts = []
    if doc.get("rows"):
        parts.append(markdown_table([_display(r) for r in doc["rows"]], COLUMNS))
    pol = doc.get("policies")
    if pol:
        parts.append(markdown_table([_display(r) for r in pol["rows"]], POLICY_COLUMNS))
        lines = ["| baseline | TTFT gain s (95% CI) | latency gain s (95% CI) |", "|---|---|---|"]
        for base, cis in pol["avmp_gain_ci95"].items():
            cells = []
            for key in ("ttft_s", "latency_s"):
                c = cis[key]
                cells.append(
                    "n/a" if c is None else f"{c['mean_gain']:.3g} [{c['lo']:.3g}, {c['hi']:.3g}]"
                )
            lines.append(f"| {base} | {cells[0]} | {cells[1]} |")
        parts.append("\n".join(lines))
        if pol.get("repeats", 1) > 1:
            med = pol["median_request_throughput"]
            parts.append(
                f"median req/s over {pol['repeats']} repeats: "
                + ", ".join(f"{p} {v:.3g}" for p, v in med.items())
            )
    return "\n\n".join(parts)


def _rate(r) -> float:
    return math.inf if r == "inf" else float(r)


def plots(doc: dict, out_dir: Path, stem: str) -> list[Path]:
    """``<stem>_throughput.png`` (request and token throughput against the offered rate, one
    line per method and workload) and ``<stem>_ttft_cdf.png`` (TTFT CDF per method at each
    workload's highest finite rate, or its only rate). ``[]`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# plots skipped: matplotlib is not installed (pip install '.[bench]')")
        return []
    rows = doc.get("rows") or []
    if not rows:
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    workloads = sorted({r["workload"] for r in rows})
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    methods = list(dict.fromkeys(r["method"] for r in rows))  # one colour a method everywhere
    color = {m: cycle[i % len(cycle)] for i, m in enumerate(methods)}
    paths = []
    fig, axes = plt.subplots(len(workloads), 2, figsize=(11, 4 * len(workloads)), squeeze=False)
    for ax_row, wl in zip(axes, workloads, strict=True):
        sub = [r for r in rows if r["workload"] == wl]
        finite = [_rate(r["rate"]) for r in sub if not math.isinf(_rate(r["rate"]))]
        sat = 2 * max(finite) if finite else 1.0  # where "inf" (saturation) is drawn
        for m in dict.fromkeys(r["method"] for r in sub):
            pts = sorted(
                (sat if math.isinf(_rate(r["rate"])) else _rate(r["rate"]), r)
                for r in sub
                if r["method"] == m
            )
            xs = [x for x, _ in pts]
            style = dict(marker="o", label=m, color=color[m])
            ax_row[0].plot(xs, [r["request_throughput"] for _, r in pts], **style)
            ax_row[1].plot(xs, [r["token_throughput"] for _, r in pts], **style)
        for ax, what in zip(ax_row, ("requests / s", "tokens / s"), strict=True):
            ax.set_xscale("log")
            ax.set_xlabel(f"offered rate (req/s; saturation drawn at {sat:g})")
            ax.set_ylabel(what)
            ax.set_title(f"{wl}: {what} served")
            ax.grid(alpha=0.3)
        ax_row[0].legend(fontsize=7)
    fig.tight_layout()
    paths.append(out_dir / f"{stem}_throughput.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4), squeeze=False)
    for ax, wl in zip(axes[0], workloads, strict=True):
        sub = [r for r in rows if r["workload"] == wl]
        finite = [_rate(r["rate"]) for r in sub if not math.isinf(_rate(r["rate"]))]
        pick = max(finite) if finite else math.inf
        for r in sub:
            if _rate(r["rate"]) != pick:
                continue
            x = np.sort([1e3 * v for v in r["ttft_s"] if v is not None])
            ax.step(
                x,
                np.arange(1, len(x) + 1) / max(1, len(x)),
                where="post",
                label=r["method"],
                color=color[r["method"]],
            )
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{wl}: TTFT CDF at rate {pick:g} req/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out_dir / f"{stem}_ttft_cdf.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
