"""Cheap checks of the benchmarks' shared helpers (``benchmarks.common``), of
``benchmarks.spec_memory`` (exact byte counts) and of ``benchmarks.kernels``' input helpers."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from benchmarks import common, spec_memory


def test_gdn_dims_of_the_shipped_configs():
    names = common.config_names()
    assert {"qwen3_5_35b_a3b", "qwen3_5_397b_a17b"} <= set(names)
    d = common.gdn_dims("qwen3_5_35b_a3b")
    assert (d.num_gdn_layers, d.num_attn_layers) == (30, 10)
    assert (d.hk, d.hv, d.k, d.v, d.conv_width) == (16, 32, 128, 128, 4)
    assert d.conv_dim == 2 * 16 * 128 + 32 * 128
    with pytest.raises(ValueError, match="neither a file nor one of"):
        common.load_config("no_such_config")


def test_parse_blocks_and_tables():
    @dataclasses.dataclass(frozen=True)
    class Blocks:
        block_v: int = 64
        fast: bool = False
        precision: str = "bf16x3"

    got = common.parse_blocks(["", "block_v=32,fast=true,precision=tf32x3"], Blocks)
    assert got == [Blocks(), Blocks(32, True, "tf32x3")]
    assert common.parse_blocks([], Blocks) == [Blocks()]
    table = common.markdown_table([dict(a=1, b=0.123456), dict(a=2)], ["a", ("b", "B")])
    assert table.splitlines() == ["| a | B |", "|---|---|", "| 1 | 0.123 |", "| 2 |  |"]
    assert common.fmt_bytes(1536) == "1.5 KiB" and common.fmt_bytes(12) == "12 B"
    assert common.ints("1,16,64") == [1, 16, 64]


def test_spec_memory_rows(tmp_path, capsys):
    out = tmp_path / "spec.json"
    argv = ["--config", "qwen3_5_35b_a3b", "--nodes", "64", "--batch", "1", "16"]
    rows = spec_memory.main([*argv, "--json", str(out)])
    assert json.loads(out.read_text()) == rows
    one, sixteen = rows
    # per node and GDN layer: a 32 x 128 x 128 f32 state against U, k, G and the parent
    assert one["snapshot_state_bytes"] == 64 * 30 * 32 * 128 * 128 * 4
    assert one["wy_state_bytes"] == 64 * 30 * (32 * 128 * 4 + 16 * 128 * 2 + 32 * 4 + 4)
    assert sixteen["snapshot_per_seq_bytes"] == one["snapshot_per_seq_bytes"]
    assert round(one["state_ratio"]) == 102
    assert "qwen3_5_35b_a3b" in capsys.readouterr().out


def test_kernel_inputs():
    kernels = pytest.importorskip("benchmarks.kernels")
    par = kernels.random_parents(np.random.default_rng(0), 3, 20, chain=False)
    assert (par[:, 0] == -1).all() and (par[:, 1:] < np.arange(1, 20)).all()
    path, plen = kernels.deepest_path(par)
    for r in range(3):  # a root-to-node chain of parents
        p = path[r, : plen[r]]
        assert p[0] == 0 and all(par[r, p[i]] == p[i - 1] for i in range(1, len(p)))
    chain = kernels.random_parents(None, 2, 5, chain=True)
    assert kernels.deepest_path(chain)[1].tolist() == [5, 5]
    assert kernels.chunk_shapes("4096x1;16384x4") == [(4096, 1), (16384, 4)]
    assert kernels.rel_err_key(0) == "rel_err_vs_xla" and kernels.rel_err_key(2) == "rel_err2"


def test_spec_step_rows(tmp_path, capsys):
    from benchmarks import spec_step

    out = tmp_path / "spec_step.json"
    rows = spec_step.main(["--batch", "2", "--tree", "2,1", "--reps", "1", "--json", str(out)])
    assert json.loads(out.read_text()) == rows
    (row,) = rows
    assert row["batch"] == 2 and row["nodes"] == 5 and row["kernels"] == "xla"
    assert all(row[k] > 0 for k in ("decode_ms", "spec_step_ms", "verify_ms"))
    assert row["spec_over_decode"] == row["spec_step_ms"] / row["decode_ms"]
    assert "| spec step ms |" in capsys.readouterr().out


def test_spec_step_at_a_config_drafts_with_its_mtp_head(tmp_path):
    """``--config``: random weights at a config's size (here a 4-layer MoE config cut to tiny
    dims), drafted by its MTP head, with the drafting's model part timed alone."""
    from benchmarks import spec_step
    from benchmarks.common import load_config
    from benchmarks.layers import SMOKE

    _, cfg = load_config("qwen3_5_35b_a3b")
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
    cfg.update(SMOKE, vocab_size=512, num_hidden_layers=4)
    cfg.pop("layer_types", None)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    argv = ["--config", str(path), "--method", "mtp", "--batch", "1", "--tree", "2,1"]
    (row,) = spec_step.main([*argv, "--reps", "1"])
    assert row["method"] == "mtp" and row["nodes"] == 5 and row["draft_ms"] > 0
    assert row["other_share"] == pytest.approx(
        (row["spec_step_ms"] - row["verify_ms"] - row["draft_ms"]) / row["spec_step_ms"]
    )
    with pytest.raises(SystemExit):  # random weights have no draft model
        spec_step.main(["--config", str(path), "--method", "draft_model"])


def test_model_step_smoke(tmp_path, capsys):
    """Every step's row with a positive time and floor; the floor grows with the batch."""
    from benchmarks import model_step

    out = tmp_path / "model_step.json"
    doc = model_step.main(["--smoke", "--profile", "--json", str(out)])
    assert json.loads(out.read_text())["rows"] == doc["rows"]
    steps = [r["step"] for r in doc["rows"]]
    assert steps == ["decode", "decode", "verify N 5", "verify N 9", "prefill step", "prefill 64"]
    assert all(r["ms"] > 0 and r["floor_ms"] > 0 for r in doc["rows"])
    d1, d4 = doc["rows"][:2]
    assert d4["floor_bytes"] > d1["floor_bytes"]
    assert all(d["held_ms"] > 0 and d["pipelined_ms"] > 0 and d["finite"] for d in (d1, d4))
    assert "| / floor |" in capsys.readouterr().out


def test_arena_programs_update_the_arena_in_place():
    """The XLA path's prefill, decode, verify and commit programs and the one-program
    speculative step compile to no whole-arena copy and scratch far below the arena's size."""
    from benchmarks import arena_copies

    rows = arena_copies.main(["--kernels", "xla", "--layers", "4"])
    assert {r["program"] for r in rows} == {"prefill", "decode", "verify", "commit", "spec_step"}
    for r in rows:
        assert r["arena_copies"] == 0, r
        assert r["temp_over_arena"] < 0.1, r
        assert r["launches"] > 0, r


def test_kernel_profile_summarizes_calls():
    """Kernel events of three calls (told apart by idle gaps): per-call counts, busy time,
    span and the kernels by time, XLA's numeric suffixes folded into one name."""
    from benchmarks.kernel_profile import GAP_NS, summarize

    events = []
    for c in range(3):
        t0 = c * 4 * GAP_NS
        events += [
            (f"loop_add_fusion.{c}", t0, 1000.0),
            ("gemm_fusion_dot_12", t0 + 3000, 5000.0),
            ("loop_add_fusion.7", t0 + 9000, 2000.0),
        ]
    out = summarize(events[::-1])
    assert out["calls"] == 3 and out["kernels"] == 3
    assert out["busy_ms"] == pytest.approx(8e-3) and out["span_ms"] == pytest.approx(11e-3)
    assert [(r["name"], r["per_call"]) for r in out["top"]] == [
        ("gemm_fusion_dot", 1),
        ("loop_add_fusion", 2),
    ]
    assert "sequence" not in out
    # the call of median busy time, kernel by kernel in launch order (the first call's
    # gemm takes longer, the second's shorter, so the third is the median)
    events[1] = ("gemm_fusion_dot_12", 3000.0, 9000.0)
    events[4] = ("gemm_fusion_dot_12", 4 * GAP_NS + 3000, 1000.0)
    seq = summarize(events, sequence=True)["sequence"]
    assert seq == [
        ["loop_add_fusion.2", 1.0],
        ["gemm_fusion_dot_12", 5.0],
        ["loop_add_fusion.7", 2.0],
    ]


def test_step_kernels_counts_entry_launches():
    """Launches of the entry computation by kind: Pallas (Triton) custom calls, GEMMs (library
    calls and GEMM fusions), other fusions, sorts and copies; nested computations not counted."""
    from benchmarks.step_kernels import entry_launches

    hlo = """HloModule m
%fused_computation.1 (p: f32[4]) -> f32[4] {
  %x = f32[4] fusion(%p), kind=kLoop, calls=%inner
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %f.1 = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused_computation.1
  %gemm_fusion_dot.3 = f32[4]{0} fusion(%f.1), kind=kCustom, calls=%gemm_fusion_dot.3_computation
  %loop_pad_fusion.4 = f32[4]{0} fusion(%gemm_fusion_dot.3), kind=kLoop, calls=%fused_pad
  %t.6 = f32[4]{0} fusion(%f.1), kind=kCustom, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %p.2 = f32[4]{0} custom-call(%f.1), custom_call_target="__gpu$xla.gpu.triton"
  %c.5 = f32[4]{0} custom-call(%p.2), custom_call_target="__cublas$lt$matmul"
  %s = f32[4]{0} sort(%c.5), dimensions={0}
  ROOT %y = f32[4]{0} copy(%s)
}
"""
    assert entry_launches(hlo) == dict(launches=8, pallas=1, gemm=3, fusion=2, other=2)


def test_dispatch_smoke(tmp_path):
    """One row per argument count, the per-argument cost against the one-argument program."""
    from benchmarks import dispatch

    out = tmp_path / "dispatch.json"
    rows = dispatch.main(["--args", "1,32", "--reps", "5", "--json", str(out)])
    assert [r["args"] for r in rows] == [1, 32]
    assert rows[0]["us_per_arg"] is None and rows[1]["us_per_arg"] is not None
    assert all(r["call_us"] >= r["dispatch_us"] > 0 for r in rows)
    assert json.loads(out.read_text())["rows"] == rows


def test_attention_splits_smoke(tmp_path):
    """The key-split benchmark's rows: the automatic count splits a batch-1 decode, and its
    output agrees with one split and with float64 (interpret mode)."""
    from benchmarks import attention_splits

    out = tmp_path / "splits.json"
    rows = attention_splits.main(
        ["--smoke", "--batch", "1", "--context", "256", "--json", str(out)]
    )
    assert json.loads(out.read_text())["rows"] == rows
    [row] = rows
    assert row["splits"] > 1 and row["us_auto"] > 0
    assert row["err_auto"] < 1e-2 and row["diff"] < 1e-2


def test_fused_projections_smoke(tmp_path):
    """Both engines' rows, every round kept, the fused one with fewer weight arrays."""
    from benchmarks import fused_projections

    doc = fused_projections.main(["--smoke", "--json", str(tmp_path / "f.json")])
    fused, plain = doc["rows"]
    assert (fused["fused"], plain["fused"]) == (True, False)
    assert fused["weight_arrays"] < plain["weight_arrays"]
    assert len(fused["rounds"]["ms"]) == 2 and fused["ms_ratio"] > 0
    assert json.loads((tmp_path / "f.json").read_text())["rows"][0]["batch"] == 2


def test_moe_dry_run_with_a_shared_expert(tmp_path):
    """``benchmarks.moe --shared-inter``: every path adds the shared expert's down projection
    (the decode kernel in its launch) and lands near the XLA path; the floor counts its bytes."""
    from benchmarks import moe

    out = tmp_path / "moe.json"
    moe.main(["--dry-run", "--paths", "xla,decode", "--json", str(out)])
    plain = {(r["m"], r["path"]): r for r in json.loads(out.read_text())["rows"]}
    moe.main(["--dry-run", "--paths", "xla,decode", "--shared-inter", "16", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert {(r["m"], r["path"]) for r in rows} == {
        (m, p) for m in (1, 4) for p in ("xla", "decode")
    }
    for r in rows:
        assert "error" not in r and "skipped" not in r, r
        assert r["bytes"] == plain[r["m"], r["path"]]["bytes"] + (32 + r["m"]) * 16 * 2
        if r["path"] == "decode":
            assert r["rel_err"] < 2e-2, r


def test_moe_dry_run_of_the_mosaic_gpu_decode_kernel(tmp_path):
    """``--paths decode_mgpu``: Mosaic GPU's interpret mode at shapes it takes (H 128, I 64,
    the shared term in its launch) near the XLA path; at the default dry-run shapes a row saying
    why it cannot run."""
    from benchmarks import moe

    out = tmp_path / "moe.json"
    args = ["--dry-run", "--paths", "xla,decode_mgpu", "--hidden", "128", "--inter", "64"]
    moe.main([*args, "--m", "1,2", "--shared-inter", "64", "--json", str(out)])
    rows = [r for r in json.loads(out.read_text())["rows"] if r["path"] == "decode_mgpu"]
    assert [r["m"] for r in rows] == [1, 2]
    for r in rows:
        assert "error" not in r and "skipped" not in r, r
        assert r["rel_err"] < 2e-2, r
    moe.main(["--dry-run", "--paths", "decode_mgpu", "--m", "1", "--json", str(out)])
    [row] = json.loads(out.read_text())["rows"]
    assert "multiple of 64" in row["skipped"], row
