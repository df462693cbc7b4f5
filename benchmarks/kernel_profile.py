"""The device kernels of a program, from jax's own profiler trace (no external tools).

:func:`profile` runs a call a few times under :func:`jax.profiler.trace`, reads the trace back
with :class:`jax.profiler.ProfileData` and sums the device's kernel events per call: how many
kernels one call launches, the time the device spent in them (busy), the span from the first
kernel's start to the last one's end, and the kernels that took the most time, by name. Busy
time well below the call's wall time means the device waited (on the host's dispatch or
between kernels); busy time near it means the kernels themselves bound the step.

While a trace is active XLA runs a GPU program kernel by kernel, not as its CUDA graph
(:mod:`serving.launch`), so the span is that of kernel-by-kernel launches; the kernels and
their times are the graph's. On a backend whose trace has no device plane (the CPU), the result
says so and has no figures.
"""

from __future__ import annotations

import collections
import glob
import re
import tempfile
import time

import jax

GAP_NS = 50e6


def _device_events(path: str) -> tuple[list[tuple[str, float, float]], list[str]]:
    """``(name, start_ns, duration_ns)`` of every kernel event on the device planes' stream
    lines (not their per-op / per-module summary lines), and the device lines' names."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(path)
    events, names = [], []
    for plane in data.planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            names.append(f"{plane.name}: {line.name}")
            if not line.name.lower().startswith("stream"):
                continue
            for e in line.events:
                if e.duration_ns > 0:
                    events.append((e.name, float(e.start_ns), float(e.duration_ns)))
    return events, names


def _family(name: str) -> str:
    """A kernel's name without the numbers XLA appends (``fusion.123`` -> ``fusion``)."""
    return re.sub(r"[._]\d+$", "", re.sub(r"(_\d+)+$", "", name))


def profile(fn, block, calls: int = 5, top: int = 12, sequence: bool = False) -> dict:
    """Profiles ``calls`` calls of ``fn()`` (each blocked by ``block(out)``).

    Returns ``kernels`` (kernel events per call), ``busy_ms`` (their summed time per call),
    ``span_ms`` (first kernel start to last kernel end, median over calls; the calls are
    told apart by an idle gap put between them), and ``top``: ``[{name, per_call, ms}]`` by time.
    With ``sequence``, also ``sequence``: ``[name, us]`` of every kernel of the call whose busy
    time is the median, in launch order (to match kernels to the program's HLO one by one)."""
    block(fn())
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(calls):
                block(fn())
                time.sleep(GAP_NS / 1e9)  # an idle gap that separates the calls' kernels
        paths = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
        events, lines = _device_events(paths[0]) if paths else ([], [])
    if not events:
        return {"kernels": None, "note": "no device kernel events in the trace", "lines": lines}
    return summarize(events, top, sequence)


def summarize(
    events: list[tuple[str, float, float]], top: int = 12, sequence: bool = False
) -> dict:
    """:func:`profile`'s figures from kernel events ``(name, start_ns, duration_ns)`` of
    several calls, the calls told apart by idle gaps of more than ``GAP_NS / 2``."""
    events = sorted(events, key=lambda e: e[1])
    # split into calls at the host gaps (each call is blocked on before the next starts)
    groups, cur, end = [], [], 0.0
    for e in events:
        if cur and e[1] - end > GAP_NS / 2:
            groups.append(cur)
            cur = []
        cur.append(e)
        end = max(end, e[1] + e[2])
    groups.append(cur)
    spans = sorted((max(e[1] + e[2] for e in g) - g[0][1]) / 1e6 for g in groups)
    by_name: dict = collections.defaultdict(lambda: [0, 0.0])
    for name, _, dur in events:
        acc = by_name[_family(name)]
        acc[0] += 1
        acc[1] += dur
    n = len(groups)
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    out = {
        "calls": n,
        "kernels": len(events) / n,
        "busy_ms": sum(e[2] for e in events) / n / 1e6,
        "span_ms": spans[len(spans) // 2],
        "top": [{"name": k, "per_call": c / n, "ms": t / n / 1e6} for k, (c, t) in rows],
    }
    if sequence:
        mid = sorted(groups, key=lambda g: sum(e[2] for e in g))[n // 2]
        out["sequence"] = [[name, round(dur / 1e3, 3)] for name, _, dur in mid]
    return out
