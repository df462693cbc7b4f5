"""Running the study: one cell under every policy on one draw of its requests
(:func:`run_cell`), and one cell on several draws (:func:`seed_sweep`).

Scaling: the big configs keep their first 4 layers (3 GDN + 1 attention, one period of the
3:1 pattern; ``layout_for(..., num_layers=4)``) so that the arena is a few hundred MB on a CPU
while the KV-bytes-per-token to state-slot ratio, which decides every trade-off here, is the
full model's. A cell's budget is a number of state slots of that scaled layout.

Seeds: cell ``i`` of a run's cell list draws its requests with seed ``seed + i`` (``--seed``,
default 0), so the full preset's cell ``i`` has seed ``i``. A seed sweep's draw ``k`` of a cell
has that seed plus ``k * SWEEP_SEED_STRIDE``: draw 0 is the full study's own.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from benchmarks.memory_trace.scheduler import Sim
from benchmarks.memory_trace.stats import compare, latencies, paired_bootstrap
from benchmarks.memory_trace.workload import CONFIGS, POLICIES, PRESETS, Cell, make_requests
from serving.memory import layout_for

SWEEP_SEED_STRIDE = 1000


def _run_cell(cell: Cell, preset: dict, seed: int) -> tuple[dict, dict]:
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
        sim = Sim(
            layout,
            budget,
            policy,
            cell,
            spec["cost"],
            max_prefill_tokens=preset.get("max_prefill_tokens"),
            chunked_prefill=preset.get("chunked_prefill"),
        )
        out["policies"][policy] = sim.run(req)
    out["horizon_s"] = max(m["makespan_s"] for m in out["policies"].values())
    out.update(compare(out["policies"], req["arrival"], seed))
    return out, req


def run_cell(cell: Cell, preset: dict, seed: int) -> dict:
    """Every policy on the same ``preset["requests"]`` requests of ``cell`` (seed ``seed``):
    each policy's metrics (:meth:`Sim.run`) and AVMP's latency verdicts against each baseline
    (:func:`~benchmarks.memory_trace.stats.compare`). ``preset`` holds ``requests``,
    ``page_size``, ``spec_nodes``, ``budgets`` and optionally ``max_prefill_tokens`` or
    ``chunked_prefill``."""
    return _run_cell(cell, preset, seed)[0]


def run_indexed(job: tuple[int, Cell, dict, int]) -> tuple[int, dict]:
    """``(i, run_cell(cell, preset, seed + i))`` for ``job = (i, cell, preset, seed)``: the
    unit of work of a run's worker processes."""
    i, cell, preset, seed = job
    return i, run_cell(cell, preset, seed + i)


def seed_sweep(cells: list[Cell], preset: dict, seeds: int, base_seed: int = 0) -> dict:
    """Named cells of the full grid at ``seeds`` draws each (draw 0 is the study's own, see
    the module docstring). Per baseline: the per-draw verdicts, one paired bootstrap over the
    censored latencies of every draw's requests together (is a per-draw verdict a property of
    the cell's configuration, or of one draw of its requests?), and the geometric-mean
    throughput ratio over draws."""
    grid = [c.name for c in PRESETS["full"]["cells"]]
    bases = POLICIES[1:]
    out = {}
    for cell in cells:
        runs, diffs = [], {b: ([], []) for b in bases}
        for k in range(seeds):
            seed = base_seed + grid.index(cell.name) + k * SWEEP_SEED_STRIDE
            r, req = _run_cell(cell, preset, seed)
            _, censored = latencies(r["policies"], req["arrival"])
            for b in bases:
                diffs[b][0].append(censored["avmp"])
                diffs[b][1].append(censored[b])
            runs.append(
                {
                    "seed": seed,
                    "verdicts": {b: r["ci_latency_s"][b]["verdict"] for b in bases},
                    "mean_gain_s": {b: r["ci_latency_s"][b]["mean_gain"] for b in bases},
                    "requests_per_s": {p: m["requests_per_s"] for p, m in r["policies"].items()},
                }
            )
        rng = np.random.default_rng(base_seed)
        per_base = {}
        for b in bases:
            mean, lo, hi = paired_bootstrap(
                np.concatenate(diffs[b][0]), np.concatenate(diffs[b][1]), rng
            )
            verdicts = [x["verdicts"][b] for x in runs]
            ratios = [x["requests_per_s"]["avmp"] / x["requests_per_s"][b] for x in runs]
            per_base[b] = {
                "seeds_better": verdicts.count("avmp better"),
                "seeds_tie": verdicts.count("tie"),
                "seeds_worse": verdicts.count("avmp worse"),
                "seeds_mean_gain_negative": sum(x["mean_gain_s"][b] < 0 for x in runs),
                "pooled_mean_gain_s": mean,
                "pooled_lo": lo,
                "pooled_hi": hi,
                "throughput_ratio_geomean": float(np.exp(np.mean(np.log(ratios)))),
            }
        out[cell.name] = {"seeds": runs, "vs": per_base}
    return out
