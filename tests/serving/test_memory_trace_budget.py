"""The memory study's scheduler model with a per-step prefill token budget
(``benchmarks.memory_trace --max-prefill-tokens``): every request still completes, and a budget
below every prompt (one admission per step) changes a batch arrival's schedule, and stretches
it where memory did not already limit admission."""

from __future__ import annotations

from benchmarks import memory_trace as mt


def _run(cap):
    preset = dict(mt.PRESETS["smoke"], requests=12)
    preset.pop("cells")
    if cap:
        preset["max_prefill_tokens"] = cap
    cell = mt.Cell("tiny", "short", "short", "batch", "loose", "stash")
    return mt.run_cell(cell, preset, seed=3)["policies"]


def test_prefill_budget_admits_one_prompt_per_step():
    free, capped = _run(None), _run(1)
    for policy in mt.POLICIES:
        a, b = free[policy], capped[policy]
        assert a["completed"] == b["completed"] == 12
        assert b["peak_concurrency"] <= a["peak_concurrency"]
        # the cap binds: a different schedule for every policy. Longer for the policies that
        # lend memory between KV and state, whose uncapped admissions memory does not limit;
        # static_dual's fixed pools stall admission anyway (with the larger tree-WY stash,
        # one prompt per step happens to pack its pools better and finishes 2% sooner).
        assert b["makespan_s"] != a["makespan_s"]
        if policy != "static_dual":
            assert b["makespan_s"] > a["makespan_s"]
