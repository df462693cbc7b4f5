"""``benchmarks/arena_read.py --step prefill``: the CPU smoke run (interpret-mode arena prefill
kernel) writes a row per ``(B, T)`` with timings, the floor and the kernel's exactness against
the XLA windows."""

from __future__ import annotations

import json

from benchmarks import arena_read


def test_prefill_smoke_json(tmp_path, capsys):
    out = tmp_path / "prefill.json"
    arena_read.main(["--step", "prefill", "--smoke", "--reps", "1", "--json", str(out)])
    doc = json.loads(out.read_text())
    assert doc["step"] == "prefill"
    assert doc["chunk_impl"] == "xla"  # CPU: the engine's "auto" chunked rule is XLA's
    rows = doc["rows"]
    assert [(r["batch"], r["chunk"]) for r in rows] == [(1, 16), (2, 16)]
    for r in rows:
        assert r["gdn_layers"] == 3
        for key in ("native_s", "arena_s", "arena_kernel_s", "floor_s"):
            assert r[key] > 0, key
        assert r["kernel_over_arena"] == r["arena_kernel_s"] / r["arena_s"]
        assert r["bytes_moved"] > 0
        assert r["exact"] is True
        assert r["state_rel_err"] <= doc["state_tol"] == 1e-3
        assert r["out_rel_err"] <= doc["out_tol"]
        assert 0 <= r["state_max_abs_diff"] and 0 <= r["out_max_abs_diff"]
    table = capsys.readouterr().out
    assert "kernel / arena" in table and table.count("\n| 1 | 16 |") == 1
