"""The compiler's report for Pallas kernels without a GPU: registers, spills and shared memory
on sm_90 (H200), per blocks spec: the tree-verify kernel (``VerifyBlocks``, the default) or,
with ``--kernel chunk_v2``, each of the three kernels of the chunked prefill
(``ChunkBlocks``; intra, state, out).

Lowers the kernel with jax for compute capability 9.0 on the CPU (the Pallas Triton lowering
only asks for the GPU's compute capability), then compiles the Triton IR with a separately
installed Triton and runs ``ptxas -v``. Triton must not live in the project's venv (it would
change what transformers routes to in the tests); install it aside:

    python -m pip install --target /tmp/tri triton==3.6.0
    PYTHONPATH=. .venv/bin/python benchmarks/compile_report.py --triton-path /tmp/tri \\
        "precision=bf16x3" "precision=bf16x3,block_v=32,num_warps=8"

On the H200, session 2, the default spec's figures (255 registers, 64 KiB) matched Nsight
Compute's. Shape: ``--batch``, ``--hv`` (Hk 16), ``--nodes``; K = V = 128, bf16 q/k/v.
The chunk prefill (shape ``--batch`` x ``--tokens``, Hv ``--hv``, chunk 64; the kernels'
register use does not depend on the shape)::

    PYTHONPATH=. .venv/bin/python benchmarks/compile_report.py --kernel chunk_v2 --batch 1 \\
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
from pathlib import Path

import jax
import jax.numpy as jnp
from jax._src.pallas.triton import gpu_info, lowering, pallas_call_registration

import pallas_kernels as pk
from benchmarks.kernels import parse_blocks


def _lower_capturing(fn, args) -> list[tuple[str, str]]:
    """Lowers ``jax.jit(fn)(*args)`` for sm_90 on this machine and returns each Pallas kernel's
    ``(function name, Triton IR text)``."""
    _force_h200()
    captured = []
    orig = lowering.lower_jaxpr_to_triton_module

    def capture(jaxpr, *a, **kw):
        out = orig(jaxpr, *a, **kw)
        captured.append((jaxpr.debug_info.func_name,
                         out.module.operation.get_asm(enable_debug_info=False)))  # fmt: skip
        return out

    pallas_call_registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        pallas_call_registration.lowering.lower_jaxpr_to_triton_module = orig
    return captured


def lower_verify(spec: str, b: int, hv: int, n: int) -> tuple[pk.VerifyBlocks, str]:
    """``(blocks, Triton IR text)`` of the verify kernel lowered for sm_90 on this machine."""
    bl = parse_blocks([spec], pk.VerifyBlocks)[0]
    s = jax.ShapeDtypeStruct
    bf, f32 = jnp.bfloat16, jnp.float32
    args = (s((b, n, 16, 128), bf), s((b, n, 16, 128), bf), s((b, n, hv, 128), bf),
            s((b, n, hv), f32), s((b, n, hv), f32), s((b, n), jnp.int32),
            s((b, hv, 128, 128), f32))  # fmt: skip
    captured = _lower_capturing(lambda *a: pk.tree_verify(*a, use_qk_l2norm=True, blocks=bl), args)
    return bl, captured[-1][1]


def _force_h200():
    h200 = gpu_info.GpuInfo(
        gpu_version=gpu_info.GpuVersion.H200, arch_name="9.0", compute_capability=90
    )
    gpu_info.get_gpu_info = lambda: h200
    pallas_call_registration.gpu_info_lib.get_gpu_info = lambda: h200


def lower_chunk_v2(spec: str, b: int, t: int, hv: int) -> tuple[pk.ChunkBlocks, list]:
    """``(blocks, [(kernel name, Triton IR text, warps, stages)])`` of the three chunk_v2 kernels
    lowered for sm_90 on this machine (bf16 q/k/v, Hk 16, K = V = 128, chunk 64, l2norm)."""
    bl = parse_blocks([spec], pk.ChunkBlocks)[0]
    s = jax.ShapeDtypeStruct
    bf, f32 = jnp.bfloat16, jnp.float32
    args = (s((b, t, 16, 128), bf), s((b, t, 16, 128), bf), s((b, t, hv, 128), bf),
            s((b, t, hv), f32), s((b, t, hv), f32), s((b, hv, 128, 128), f32))  # fmt: skip
    captured = _lower_capturing(
        lambda *a: pk.chunk_gated_delta_rule(*a, use_qk_l2norm=True, blocks=bl), args)
    knobs = {"intra": (bl.warps_intra, 1), "state": (bl.warps_state, bl.stages_state),
             "out": (bl.warps_out, 1)}  # fmt: skip
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
    k = triton.compile(str(path), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=num_warps, num_stages=num_stages))  # fmt: skip
    ptx = k.asm["ptx"]
    ptx_path = path.with_suffix(".ptx")
    ptx_path.write_text(ptx)
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    err = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(ptx_path), "-o", "/dev/null"],
                         capture_output=True, text=True).stderr  # fmt: skip
    num = lambda pat: int(m.group(1)) if (m := re.search(pat, err)) else None
    return dict(
        registers=num(r"Used (\d+) registers"), spill_stores_B=num(r"(\d+) bytes spill stores"),
        spill_loads_B=num(r"(\d+) bytes spill loads"),
        shared_KiB=k.metadata.shared / 1024, wgmma=ptx.count("wgmma.mma_async"),
        mma_sync=ptx.count("mma.sync"),
    )  # fmt: skip


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("specs", nargs="*", default=[""],
                   help="VerifyBlocks / ChunkBlocks specs ('' = defaults)")  # fmt: skip
    p.add_argument("--kernel", choices=("verify", "chunk_v2"), default="verify")
    p.add_argument("--tokens", type=int, default=256, help="chunk_v2: T (tokens per sequence)")
    p.add_argument("--json", default="", help="also write the rows here")
    p.add_argument("--triton-path", default="/tmp/tri", help="where Triton is installed")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--hv", type=int, default=32)
    p.add_argument("--nodes", type=int, default=64)
    args = p.parse_args(argv)
    if args.kernel == "chunk_v2":
        return main_chunk_v2(args)
    lowered = [lower_verify(spec, args.batch, args.hv, args.nodes) for spec in args.specs]
    sys.path.insert(0, args.triton_path)
    print(
        "| VerifyBlocks | registers | spill stores (B) | shared KiB | wgmma |\n|---|---|---|---|---|"
    )
    for spec, (bl, ttir) in zip(args.specs, lowered, strict=True):
        try:
            r = compile_report(ttir, bl.num_warps, bl.num_stages)
            print(f"| `{spec or 'default'}` | {r['registers']} | {r['spill_stores_B'] or 0} | "
                  f"{r['shared_KiB']:.0f} | {r['wgmma']} |")  # fmt: skip
        except ImportError as e:
            sys.exit(f"Triton not importable from --triton-path {args.triton_path}: {e}")


def main_chunk_v2(args):
    import json
    import time

    lowered = [lower_chunk_v2(spec, args.batch, args.tokens, args.hv) for spec in args.specs]
    sys.path.insert(0, args.triton_path)
    rows = []
    print(
        "| ChunkBlocks | kernel | warps | stages | registers | spill st/ld (B) | shared KiB "
        "| blocks/SM | wgmma | mma.sync | compile s |\n|---|---|---|---|---|---|---|---|---|---|---|"
    )
    for spec, (_, kernels) in zip(args.specs, lowered, strict=True):
        for name, ttir, warps, stages in kernels:
            t0 = time.perf_counter()
            try:
                r = compile_report(ttir, warps, stages)
            except ImportError as e:
                sys.exit(f"Triton not importable from --triton-path {args.triton_path}: {e}")
            except Exception as e:  # report and go on
                print(f"| `{spec or 'default'}` | {name} | {warps} | {stages} | failed: "
                      f"{type(e).__name__}: {str(e)[:200]} |", flush=True)  # fmt: skip
                continue
            r.update(
                spec=spec,
                kernel=name,
                warps=warps,
                stages=stages,
                compile_s=time.perf_counter() - t0,
                blocks_per_sm=occupancy(r["registers"] or 255, r["shared_KiB"], warps),
            )
            rows.append(r)
            print(f"| `{spec or 'default'}` | {name} | {warps} | {stages} | {r['registers']} | "
                  f"{r['spill_stores_B'] or 0}/{r['spill_loads_B'] or 0} | {r['shared_KiB']:.1f} | "
                  f"{r['blocks_per_sm']} | {r['wgmma']} | {r['mma_sync']} | {r['compile_s']:.0f} |",
                  flush=True)  # fmt: skip
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
