"""The compiler's report for Pallas kernels without a GPU: registers, spills and shared memory
on sm_90 (H200), per blocks spec: the tree-verify kernel (``VerifyBlocks``, the default) or,
with ``--kernel chunk``, each of the three kernels of the chunked prefill (``ChunkBlocks``;
intra, state, out).

Lowers the kernel with jax for compute capability 9.0 on the CPU (the Pallas Triton lowering
only asks for the GPU's compute capability), then compiles the Triton IR with a separately
installed Triton and runs ``ptxas -v``. Triton must not live in the project's venv (it would
change what transformers routes to in the tests); install it aside:

    python -m pip install --target /tmp/tri triton==3.6.0
    .venv/bin/python -m benchmarks.compile_report --triton-path /tmp/tri \\
        "precision=bf16x3" "precision=bf16x3,block_v=32,num_warps=8"

For the default verify spec its registers and shared memory (255, 64 KiB) are Nsight Compute's
on the H200. Shape: ``--batch``, ``--hv`` (Hk 16), ``--nodes``; K = V = 128, bf16 q/k/v.
The chunked prefill (shape ``--batch`` x ``--tokens``, Hv ``--hv``, chunk 64; the kernels'
register use does not depend on the shape)::

    .venv/bin/python -m benchmarks.compile_report --kernel chunk --batch 1 \\
        "h_bf16=true" "h_bf16=true,block_v_state=64,warps_state=8"

Occupancy (blocks per SM) is ``min(65536 / (regs * 32 * warps), 228 KiB / (smem + 1 KiB),
64 / warps)`` with registers allocated per warp in units of 256 (ptxas' own figure is close).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax._src.pallas.triton import gpu_info, lowering, pallas_call_registration

import pallas_kernels as pk
from benchmarks.common import markdown_table, parse_blocks, write_json


def _lower_capturing(fn, args) -> list[tuple[str, str]]:
    """Lowers ``jax.jit(fn)(*args)`` for sm_90 on this machine and returns each Pallas kernel's
    ``(function name, Triton IR text)``."""
    _force_h200()
    captured = []
    orig = lowering.lower_jaxpr_to_triton_module

    def capture(jaxpr, *a, **kw):
        out = orig(jaxpr, *a, **kw)
        ttir = out.module.operation.get_asm(enable_debug_info=False)
        captured.append((jaxpr.debug_info.func_name, ttir))
        return out

    pallas_call_registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        pallas_call_registration.lowering.lower_jaxpr_to_triton_module = orig
    return captured


def gdn_args(b: int, t: int, hv: int, *parents) -> list[jax.ShapeDtypeStruct]:
    """Shapes of ``q, k, v, g, beta, *parents, s0``: bf16 q/k/v (Hk 16, K = V = 128), f32
    g/beta/s0."""
    s = jax.ShapeDtypeStruct
    bf, f32 = jnp.bfloat16, jnp.float32
    qk = s((b, t, 16, 128), bf)
    gates = s((b, t, hv), f32)
    return [qk, qk, s((b, t, hv, 128), bf), gates, gates, *parents, s((b, hv, 128, 128), f32)]


def lower_verify(spec: str, b: int, hv: int, n: int) -> tuple[pk.VerifyBlocks, str]:
    """``(blocks, Triton IR text)`` of the verify kernel lowered for sm_90 on this machine."""
    bl = parse_blocks([spec], pk.VerifyBlocks)[0]
    args = gdn_args(b, n, hv, jax.ShapeDtypeStruct((b, n), jnp.int32))
    captured = _lower_capturing(lambda *a: pk.tree_verify(*a, use_qk_l2norm=True, blocks=bl), args)
    return bl, captured[-1][1]


def _force_h200():
    h200 = gpu_info.GpuInfo(
        gpu_version=gpu_info.GpuVersion.H200, arch_name="9.0", compute_capability=90
    )
    gpu_info.get_gpu_info = lambda: h200
    pallas_call_registration.gpu_info_lib.get_gpu_info = lambda: h200


def lower_chunk(spec: str, b: int, t: int, hv: int) -> tuple[pk.ChunkBlocks, list]:
    """``(blocks, [(kernel name, Triton IR text, warps, stages)])`` of the chunked prefill's
    three kernels lowered for sm_90 on this machine (chunk 64, l2norm)."""
    bl = parse_blocks([spec], pk.ChunkBlocks)[0]
    captured = _lower_capturing(
        lambda *a: pk.chunk_gated_delta_rule(*a, use_qk_l2norm=True, blocks=bl), gdn_args(b, t, hv)
    )
    knobs = {
        "intra": (bl.warps_intra, 1),
        "state": (bl.warps_state, bl.stages_state),
        "out": (bl.warps_out, 1),
    }
    out = []
    for name, ttir in captured:
        key = next(k for k in knobs if name.endswith(k))
        out.append((key, ttir, *knobs[key]))
    return bl, out


def occupancy(regs: int, smem_kib: float, warps: int) -> int:
    """Blocks per SM on sm_90 from registers (per-warp allocation in 256-register units),
    shared memory (228 KiB, 1 KiB reserved per block) and the 64-warp limit."""
    per_warp = -(-regs * 32 // 256) * 256
    by_regs = 65536 // (per_warp * warps)
    by_smem = int(228 // (smem_kib + 1)) if smem_kib else 32
    return max(0, min(by_regs, by_smem, 64 // warps, 32))


def compile_report(ttir: str, num_warps: int, num_stages: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget

    path = Path(tempfile.mkdtemp()) / "kernel.ttir"
    path.write_text(ttir)
    options = dict(num_warps=num_warps, num_stages=num_stages)
    k = triton.compile(str(path), target=GPUTarget("cuda", 90, 32), options=options)
    ptx = k.asm["ptx"]
    ptx_path = path.with_suffix(".ptx")
    ptx_path.write_text(ptx)
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    cmd = [str(ptxas), "-arch=sm_90a", "-v", str(ptx_path), "-o", "/dev/null"]
    err = subprocess.run(cmd, capture_output=True, text=True).stderr
    num = lambda pat: int(m.group(1)) if (m := re.search(pat, err)) else None
    return dict(
        registers=num(r"Used (\d+) registers"),
        spill_stores_B=num(r"(\d+) bytes spill stores") or 0,
        spill_loads_B=num(r"(\d+) bytes spill loads") or 0,
        shared_KiB=k.metadata.shared / 1024,
        wgmma=ptx.count("wgmma.mma_async"),
        mma_sync=ptx.count("mma.sync"),
    )


def report(ttir: str, triton_path: str, row: dict) -> dict:
    """``row`` (with ``warps`` and ``stages``) plus :func:`compile_report`'s figures, the compile
    time and the occupancy; a failed compile is recorded in the row."""
    warps = row["warps"]
    t0 = time.perf_counter()
    try:
        row.update(compile_report(ttir, warps, row["stages"]))
    except ImportError as e:
        sys.exit(f"Triton not importable from --triton-path {triton_path}: {e}")
    except Exception as e:  # report and go on
        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        return row
    row["compile_s"] = time.perf_counter() - t0
    row["blocks_per_sm"] = occupancy(row["registers"] or 255, row["shared_KiB"], warps)
    return row


VERIFY_COLS = [
    ("spec", "VerifyBlocks"),
    "registers",
    ("spill_stores_B", "spill stores (B)"),
    ("shared_KiB", "shared KiB"),
    ("blocks_per_sm", "blocks/SM"),
    "wgmma",
    "error",
]
CHUNK_COLS = [
    ("spec", "ChunkBlocks"),
    "kernel",
    "warps",
    "stages",
    "registers",
    ("spill_stores_B", "spill st (B)"),
    ("spill_loads_B", "spill ld (B)"),
    ("shared_KiB", "shared KiB"),
    ("blocks_per_sm", "blocks/SM"),
    "wgmma",
    ("mma_sync", "mma.sync"),
    ("compile_s", "compile s"),
    "error",
]


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.compile_report",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    a = p.add_argument
    a("specs", nargs="*", default=[""], help="VerifyBlocks / ChunkBlocks specs ('' = defaults)")
    a("--kernel", choices=("verify", "chunk"), default="verify")
    a("--tokens", type=int, default=256, help="chunk: T (tokens per sequence)")
    a("--batch", type=int, default=16)
    a("--hv", type=int, default=32)
    a("--nodes", type=int, default=64, help="verify: N (draft nodes)")
    a("--triton-path", default="/tmp/tri", help="where Triton is installed")
    a("--json", default="", help="also write the rows here (after each kernel)")
    args = p.parse_args(argv)
    if args.kernel == "chunk":
        lowered = [lower_chunk(spec, args.batch, args.tokens, args.hv) for spec in args.specs]
        jobs = [
            (spec, name, ttir, warps, stages)
            for spec, (_, kernels) in zip(args.specs, lowered, strict=True)
            for name, ttir, warps, stages in kernels
        ]
        cols = CHUNK_COLS
    else:
        lowered = [lower_verify(spec, args.batch, args.hv, args.nodes) for spec in args.specs]
        jobs = [
            (spec, "verify", ttir, bl.num_warps, bl.num_stages)
            for spec, (bl, ttir) in zip(args.specs, lowered, strict=True)
        ]
        cols = VERIFY_COLS
    sys.path.insert(0, args.triton_path)
    rows = []
    for spec, name, ttir, warps, stages in jobs:
        row = dict(spec=spec, kernel=name, warps=warps, stages=stages)
        rows.append(report(ttir, args.triton_path, row))
        print(f"# `{spec}` {name}: done", file=sys.stderr, flush=True)
        write_json(args.json, rows)
    shown = [dict(r, spec=f"`{r['spec'] or 'default'}`") for r in rows]
    print(markdown_table(shown, cols, digits=4))
    return rows


if __name__ == "__main__":
    main()
