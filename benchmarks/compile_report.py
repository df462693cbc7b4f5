"""The compiler's report for the Pallas tree-verify kernel without a GPU: registers, spills and
shared memory on sm_90 (H200), per ``VerifyBlocks`` spec.

Lowers the kernel with jax for compute capability 9.0 on the CPU (the Pallas Triton lowering
only asks for the GPU's compute capability), then compiles the Triton IR with a separately
installed Triton and runs ``ptxas -v``. Triton must not live in the project's venv (it would
change what transformers routes to in the tests); install it aside:

    python -m pip install --target /tmp/tri triton==3.6.0
    PYTHONPATH=. .venv/bin/python benchmarks/compile_report.py --triton-path /tmp/tri \\
        "precision=bf16x3" "precision=bf16x3,block_v=32,num_warps=8"

On the H200, session 2, the default spec's figures (255 registers, 64 KiB) matched Nsight
Compute's. Shape: ``--batch``, ``--hv`` (Hk 16), ``--nodes``; K = V = 128, bf16 q/k/v.
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


def lower_verify(spec: str, b: int, hv: int, n: int) -> tuple[pk.VerifyBlocks, str]:
    """``(blocks, Triton IR text)`` of the verify kernel lowered for sm_90 on this machine."""
    h200 = gpu_info.GpuInfo(
        gpu_version=gpu_info.GpuVersion.H200, arch_name="9.0", compute_capability=90)
    gpu_info.get_gpu_info = lambda: h200
    pallas_call_registration.gpu_info_lib.get_gpu_info = lambda: h200
    captured = []
    orig = lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        out = orig(*args, **kwargs)
        captured.append(out.module.operation.get_asm(enable_debug_info=False))
        return out

    pallas_call_registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        bl = parse_blocks([spec], pk.VerifyBlocks)[0]
        s = jax.ShapeDtypeStruct
        bf, f32 = jnp.bfloat16, jnp.float32
        args = (s((b, n, 16, 128), bf), s((b, n, 16, 128), bf), s((b, n, hv, 128), bf),
                s((b, n, hv), f32), s((b, n, hv), f32), s((b, n), jnp.int32),
                s((b, hv, 128, 128), f32))  # fmt: skip
        fn = jax.jit(lambda *a: pk.tree_verify(*a, use_qk_l2norm=True, blocks=bl))
        fn.trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        pallas_call_registration.lowering.lower_jaxpr_to_triton_module = orig
    return bl, captured[-1]


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
        shared_KiB=k.metadata.shared / 1024, wgmma=ptx.count("wgmma.mma_async"),
    )  # fmt: skip


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("specs", nargs="*", default=[""], help="VerifyBlocks specs ('' = defaults)")
    p.add_argument("--triton-path", default="/tmp/tri", help="where Triton is installed")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--hv", type=int, default=32)
    p.add_argument("--nodes", type=int, default=64)
    args = p.parse_args(argv)
    lowered = [lower_verify(spec, args.batch, args.hv, args.nodes) for spec in args.specs]
    sys.path.insert(0, args.triton_path)
    print("| VerifyBlocks | registers | spill stores (B) | shared KiB | wgmma |\n|---|---|---|---|---|")
    for spec, (bl, ttir) in zip(args.specs, lowered, strict=True):
        try:
            r = compile_report(ttir, bl.num_warps, bl.num_stages)
            print(f"| `{spec or 'default'}` | {r['registers']} | {r['spill_stores_B'] or 0} | "
                  f"{r['shared_KiB']:.0f} | {r['wgmma']} |")  # fmt: skip
        except ImportError as e:
            sys.exit(f"Triton not importable from --triton-path {args.triton_path}: {e}")


if __name__ == "__main__":
    main()
