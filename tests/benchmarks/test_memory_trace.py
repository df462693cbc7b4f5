"""The memory study's scheduler model (``benchmarks.memory_trace``). With a per-step prefill
token budget (``--max-prefill-tokens``): every request still completes, and a budget below
every prompt (one admission per step) changes a batch arrival's schedule, and stretches it
where memory did not already limit admission. With chunked prefill (``--chunked-prefill``): a
budget no prompt reaches is the unchunked model exactly, a small one allocates KV pages chunk
by chunk and still completes every request, and bad values raise. A seed sweep starts at the
study's own draw of a cell."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.memory_trace.__main__ import main
from benchmarks.memory_trace.scheduler import Sim
from benchmarks.memory_trace.study import SWEEP_SEED_STRIDE, run_cell, seed_sweep
from benchmarks.memory_trace.workload import CONFIGS, POLICIES, PRESETS, Cell, make_requests
from serving.memory import layout_for

_CELL = Cell("tiny", "short", "short", "batch", "loose", "stash")


def _run(cap, chunk=None, cell=_CELL, requests=12):
    preset = dict(PRESETS["smoke"], requests=requests)
    preset.pop("cells")
    if cap:
        preset["max_prefill_tokens"] = cap
    if chunk:
        preset["chunked_prefill"] = chunk
    return run_cell(cell, preset, seed=3)["policies"]


def test_prefill_budget_admits_one_prompt_per_step():
    free, capped = _run(None), _run(1)
    for policy in POLICIES:
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


# Every metric of a run but the host's allocation timings.
_SAME = (
    "completed",
    "rejected",
    "makespan_s",
    "preemptions",
    "oom_events",
    "admission_stalls",
    "peak_concurrency",
    "mem_utilisation",
    "migrations",
    "migrated_bytes",
    "compactions",
    "latency_s",
)


@pytest.mark.parametrize(
    "cell", [_CELL, Cell("tiny", "shift", "mixed", "bursty", "tight", "snapshot")]
)
def test_chunk_above_every_step_is_the_unchunked_model(cell):
    whole, chunked = _run(None, cell=cell, requests=16), _run(10**9, cell=cell, requests=16)
    for policy in POLICIES:
        assert {k: whole[policy][k] for k in _SAME} == {k: chunked[policy][k] for k in _SAME}


def test_small_chunks_allocate_kv_chunk_by_chunk():
    preset = dict(PRESETS["smoke"], requests=12)
    spec = CONFIGS[_CELL.config]
    layout = layout_for(
        spec["config"], preset["page_size"], num_layers=4, spec_nodes=preset["spec_nodes"]
    )
    req = make_requests(_CELL, preset["requests"], 3, spec["cost"][0])
    budget = preset["budgets"][_CELL.budget] * layout.state_slot_bytes
    chunk = 64 + 4 * layout.spec_nodes  # 64 prompt tokens next to four decoding requests
    assert max(req["prompt"]) > 4 * chunk  # long prompts take several chunks
    for policy in POLICIES:
        runs = {}
        for c in (None, chunk):
            sim = Sim(layout, budget, policy, _CELL, spec["cost"], chunked_prefill=c)
            runs[c] = (sim.run(req), np.asarray(sim.lat_n))
        tpp = sim.mm.tokens_per_page  # unified_padded's page is enlarged
        (whole, n_whole), (part, n_part) = runs[None], runs[chunk]
        assert part["completed"] == whole["completed"] == 12
        # a whole prompt's pages in one call without chunks; at most one chunk's (+1 for a
        # chunk that straddles a page boundary) with them
        assert n_whole.max() >= -(-int(max(req["prompt"])) // tpp)
        assert n_part.max() <= -(-chunk // tpp) + 1
        # the same prompts, spread over more (shorter) steps
        assert part["makespan_s"] != whole["makespan_s"]


def test_chunked_prefill_bad_values_raise():
    spec = CONFIGS["tiny"]
    layout = layout_for(spec["config"], 32, num_layers=4, spec_nodes=8)
    budget = 12 * layout.state_slot_bytes
    with pytest.raises(ValueError, match="chunked_prefill"):
        Sim(layout, budget, "avmp", _CELL, spec["cost"], chunked_prefill=0)
    with pytest.raises(ValueError, match="pass one of them"):
        both = {"max_prefill_tokens": 2048, "chunked_prefill": 2048}
        Sim(layout, budget, "avmp", _CELL, spec["cost"], **both)
    bad = (["--chunked-prefill", "0"], ["--chunked-prefill", "64", "--max-prefill-tokens", "64"])
    for argv in bad:
        with pytest.raises(SystemExit):
            main(argv)


def test_seed_sweep_starts_at_the_study_seed():
    """``--cell NAME --seeds K``: seed 0 is the full study's own draw of that cell (its grid
    index), later seeds differ, and the pooled interval brackets the pooled mean."""
    preset = {k: v for k, v in PRESETS["full"].items() if k != "cells"}
    preset["requests"] = 12
    cell = Cell("tiny", "shift", "short", "bursty", "tight", "stash")
    index = PRESETS["full"]["cells"].index(cell)
    sweep = seed_sweep([cell], preset, seeds=2)[cell.name]
    study = run_cell(cell, preset, seed=index)
    assert [r["seed"] for r in sweep["seeds"]] == [index, index + SWEEP_SEED_STRIDE]
    assert sweep["seeds"][0]["verdicts"] == {
        b: study["ci_latency_s"][b]["verdict"] for b in POLICIES[1:]
    }
    assert sweep["seeds"][0]["requests_per_s"] != sweep["seeds"][1]["requests_per_s"]
    for v in sweep["vs"].values():
        assert v["seeds_better"] + v["seeds_tie"] + v["seeds_worse"] == 2
        assert v["pooled_lo"] <= v["pooled_mean_gain_s"] <= v["pooled_hi"]


def test_preset_run_writes_its_report(tmp_path, capsys):
    """A preset run prints the table and writes every cell's metrics, the summary and the
    run's parameters; the allocation histograms stay out of the JSON."""
    path = tmp_path / "run.json"
    main(["--preset", "smoke", "--limit", "1", "--requests", "6", "--json", str(path)])
    doc = json.loads(path.read_text())
    assert doc["preset"] == "smoke" and doc["preset_params"]["requests"] == 6
    assert [c["name"] for c in doc["cells"]] == [PRESETS["smoke"]["cells"][0].name]
    for p in POLICIES:
        assert "_alloc_hist" not in doc["cells"][0]["policies"][p]
        assert doc["summary"][p]["alloc_calls"] == doc["cells"][0]["policies"][p]["alloc_calls"]
    assert doc["summary"]["targets"]["cells"] == 1
    assert "mean over 1 cells" in capsys.readouterr().out
