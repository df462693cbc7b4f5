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
on the H200. Shape: ``--batch``, ``--hv`` (Hk 16), ``--nodes``, ``--k`` / ``--v`` (128), q/k/v
in ``--dtype`` (bf16 by default). ``--kernel arena`` / ``commit``: the verify on arena states /
the commit kernel (``CommitBlocks``; f32 U, keys in ``--dtype``).

The chunked prefill (shape ``--batch`` x ``--tokens``, Hv ``--hv``, chunk 64; the kernels'
register use does not depend on the shape)::

    .venv/bin/python -m benchmarks.compile_report --kernel chunk --batch 1 \\
        "h_bf16=true" "h_bf16=true,block_v_state=64,warps_state=8"

Occupancy (blocks per SM) is ``min(65536 / (regs * 32 * warps), 228 KiB / (smem + 1 KiB),
64 / warps)`` with registers allocated per warp in units of 256 (ptxas' own figure is close).

This Triton's shared memory is not always what the launch asks for: jax's own build (XLA's
Triton pipeline) stages twice as much for f32 q/k in the verify (256 KiB against 128 at N 128).
``--xla`` reports that build's figure instead (``xla_shared_B``, with ``fits`` the H200's
227 KiB and ``estimate_B`` the kernels' pre-launch formula): a deviceless XLA:GPU compile for an
H200 target with the limit set to 1 byte, so the pipeline's limit error states the request
(65536 B for the default bf16 verify at N 64, as Nsight measured; 262144 B for f32 at N 128,
as the H200's launch error said). It needs the CUDA plugin of the pinned jax, in a venv aside
(no GPU, CUDA or Triton needed)::

    python -m venv /tmp/cv && /tmp/cv/bin/pip install jax==0.11.2 jaxlib==0.11.2 \\
        jax-cuda12-plugin==0.11.2 jax-cuda12-pjrt==0.11.2
    /tmp/cv/bin/python -m benchmarks.compile_report --xla --nodes 128 --dtype float32 \\
        "precision=tf32x3" "precision=bf16x3"

The MoE kernels the same way, in that venv: ``--kernel moe_decode`` gives the decode kernel's
request per ``DecodeBlocks`` spec, dtype and shared term (none, a pair, a ``SharedGLU``);
``--kernel moe_routes`` compiles ``routed_experts(impl="pallas")`` (the blocks its route picks)
at the H200's real limit for each dtype and token count of ``--tokens-list``, and says whether
it fits::

    /tmp/cv/bin/python -m benchmarks.compile_report --kernel moe_decode "" "block_hs=128"
    /tmp/cv/bin/python -m benchmarks.compile_report --kernel moe_routes
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

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


def gdn_args(
    b: int, t: int, hv: int, *parents, dtype=jnp.bfloat16, dk: int = 128, dv: int = 128, sd=None
) -> list[jax.ShapeDtypeStruct]:
    """Shapes of ``q, k, v, g, beta, *parents, s0``: q/k/v in ``dtype`` (Hk 16, K ``dk``,
    V ``dv``), f32 g/beta/s0; ``sd`` makes the shapes (default ``jax.ShapeDtypeStruct``)."""
    s = sd or jax.ShapeDtypeStruct
    f32 = jnp.float32
    qk = s((b, t, 16, dk), dtype)
    gates = s((b, t, hv), f32)
    return [qk, qk, s((b, t, hv, dv), dtype), gates, gates, *parents, s((b, hv, dk, dv), f32)]


def kernel_call(kernel: str, spec: str, b: int, hv: int, n: int, dtype, dk=128, dv=128, sd=None):
    """``(blocks, fn, arg shapes)`` of one verify (``kernel`` ``"verify"``), arena verify
    (``"arena"``) or commit (``"commit"``) launch with l2norm."""
    s = sd or jax.ShapeDtypeStruct
    i32 = jnp.int32
    if kernel == "commit":
        bl = parse_blocks([spec], pk.CommitBlocks)[0]
        f32 = jnp.float32
        args = [s((b, hv, dk, dv), f32), s((b, n, 16, dk), dtype), s((b, n, hv, dv), f32)]
        args += [s((b, n, hv), f32), s((b, n), i32), s((b,), i32)]
        return bl, lambda *a: pk.tree_commit(*a, use_qk_l2norm=True, blocks=bl), args
    bl = parse_blocks([spec], pk.VerifyBlocks)[0]
    args = gdn_args(b, n, hv, s((b, n), i32), dtype=dtype, dk=dk, dv=dv, sd=s)
    if kernel == "verify":
        return bl, lambda *a: pk.tree_verify(*a, use_qk_l2norm=True, blocks=bl), args
    from pallas_kernels.verify import arena

    words = (s((4, hv * dk * dv), jnp.uint32), s((4, 2), i32), s((b,), i32))
    call = lambda *a: arena.tree_verify(*a, state_offset=0, use_qk_l2norm=True, blocks=bl)
    return bl, call, [*args[:6], *words]


def lower_verify(
    spec: str, b: int, hv: int, n: int, dtype=jnp.bfloat16, kernel: str = "verify", dk=128, dv=128
) -> tuple[pk.VerifyBlocks, str]:
    """``(blocks, Triton IR text)`` of the verify (or ``kernel``: arena verify, commit) kernel
    (q/k/v in ``dtype``) lowered for sm_90 on this machine."""
    bl, fn, args = kernel_call(kernel, spec, b, hv, n, dtype, dk, dv)
    with _no_prelaunch_limits():
        return bl, _lower_capturing(fn, args)[-1][1]


H200_TARGET = """gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 shared_memory_per_block_optin: %d threads_per_core_limit: 2048
  core_count: 132 fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 4800000000000 l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: 150754820096 registers_per_core_limit: 65536
  registers_per_block_limit: 65536 cuda_compute_capability { major: 9 }
}
platform_name: "CUDA" dnn_version_info { major: 9 minor: 8 }
runtime_version { major: 12 minor: 8 } device_description_str: "NVIDIA H200"
"""


@contextlib.contextmanager
def _no_prelaunch_limits():
    """Lifts the kernels' pre-launch GPU limits, so that what a build would ask for can be
    measured."""
    from pallas_kernels.commit import kernel as commit_kernel
    from pallas_kernels.verify import kernel as verify_kernel

    big = 1 << 40
    with (
        mock.patch.object(verify_kernel, "GPU_SHARED_MEMORY", big),
        mock.patch.object(verify_kernel, "GPU_MAX_NODES_X3", big),
        mock.patch.object(commit_kernel, "GPU_SHARED_MEMORY", big),
    ):
        yield


def h200_sharding(shared_memory_limit: int) -> jax.sharding.Sharding:
    """The one device of a deviceless H200 target (the CUDA plugin of the pinned jax compiles
    for it on a machine without a GPU) with a per-block shared memory limit in bytes; exits
    with a message when this Python has no CUDA plugin."""
    from jax.experimental import topologies

    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no CUDA runtime here
    _force_h200()
    try:
        topo = topologies.get_topology_desc(
            platform="cuda", target_config=H200_TARGET % shared_memory_limit, topology="1x1x1"
        )
    except NotImplementedError:
        sys.exit("this Python has no CUDA plugin; install jax-cuda12-plugin (see --help)")
    return jax.sharding.SingleDeviceSharding(topo.devices[0])


def xla_shared_memory(kernel: str, spec: str, b: int, hv: int, n: int, dtype, dk, dv) -> int:
    """Bytes of shared memory per block that jax's XLA:GPU build of one kernel launch asks for on
    an H200: a deviceless compile (CUDA plugin of the pinned jax) with the limit at 1 byte, whose
    limit error states the request."""
    sharding = h200_sharding(1)
    sd = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)
    _, fn, args = kernel_call(kernel, spec, b, hv, n, dtype, dk, dv, sd=sd)
    try:
        with _no_prelaunch_limits():
            jax.jit(fn).trace(*args).lower().compile()
    except Exception as e:  # the limit error is a JaxRuntimeError
        if m := re.search(r"Shared memory size limit exceeded: requested (\d+)", str(e)):
            return int(m.group(1))
        raise
    raise RuntimeError("--xla: the compile passed a 1-byte shared memory limit")


def xla_row(kernel: str, spec: str, args) -> dict:
    """A ``--xla`` row: the build's shared memory, whether it fits the H200's 227 KiB and the
    kernel's pre-launch estimate."""
    from pallas_kernels.commit.kernel import commit_shared_memory
    from pallas_kernels.verify.kernel import GPU_SHARED_MEMORY, refine_shared_memory

    dtype = jnp.dtype(args.dtype)
    need = xla_shared_memory(kernel, spec, args.batch, args.hv, args.nodes, dtype, args.k, args.v)
    bl = parse_blocks([spec], pk.CommitBlocks if kernel == "commit" else pk.VerifyBlocks)[0]
    npad, bv = max(16, 1 << (args.nodes - 1).bit_length()), min(bl.block_v, args.v)
    low = dtype == jnp.bfloat16
    estimate = commit_shared_memory if kernel == "commit" else refine_shared_memory
    row = dict(spec=spec, kernel=kernel, nodes=args.nodes, dtype=dtype.name, k=args.k, v=args.v)
    row.update(precision=bl.precision, block_v=bv, xla_shared_B=need)
    row.update(xla_shared_KiB=need / 1024, fits=need <= GPU_SHARED_MEMORY)
    if kernel == "commit" or bl.mode == "refine":
        row["estimate_B"] = estimate(npad, args.k, bv, low, bl.precision)
    return row


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
XLA_COLS = [
    ("spec", "blocks"),
    "kernel",
    "nodes",
    "dtype",
    "k",
    "block_v",
    ("xla_shared_B", "shared (B)"),
    ("xla_shared_KiB", "KiB"),
    "fits",
    ("estimate_B", "estimate (B)"),
]
MOE_COLS = [
    ("spec", "DecodeBlocks"),
    "kernel",
    "tokens",
    "dtype",
    "shared",
    ("xla_shared_B", "shared memory (B)"),
    "fits",
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


# Qwen3.5-35B-A3B's MoE (E, k, H, I, I_s): the MoE kernels' shared memory depends on their
# blocks and dtype, not on these dims (they only need to hold a block)
MOE_DIMS = (256, 8, 2048, 512, 512)
SHARED_FORMS = ("none", "pair", "glu")


def moe_args(sd, dtype, m: int, shared: str):
    """Abstract ``routed_experts`` arguments at :data:`MOE_DIMS`: ``(x, weights, experts, gate,
    up, down)`` and the ``shared`` term (``none``, a pair ``(h_s, w_s)`` or a ``SharedGLU``
    over a fused projection's output)."""
    from gdn_jax.moe import SharedGLU

    e, k, h, i, i_s = MOE_DIMS
    args = (sd((m, h), dtype), sd((m, k), dtype), sd((m, k), jnp.int32))
    args += (sd((e, h, i), dtype), sd((e, h, i), dtype), sd((e, i, h), dtype))
    if shared == "pair":
        return args, (sd((m, i_s), dtype), sd((h, i_s), dtype))
    if shared == "glu":
        act = sd((m, e + 2 * i_s + 1), dtype)
        return args, SharedGLU(
            act, sd((h, i_s), dtype), gate_col=e, up_col=e + i_s, logit_col=e + 2 * i_s
        )
    return args, None


def _compile_error(fn, args) -> int | None:
    """The shared memory a deviceless compile's limit error asks for; None if it compiled."""
    try:
        jax.jit(fn).trace(*args).lower().compile()
    except Exception as e:  # the limit error is a JaxRuntimeError
        if m := re.search(r"Shared memory size limit exceeded: requested (\d+)", str(e)):
            return int(m.group(1))
        raise
    return None


def moe_decode_rows(specs, dtypes, m: int) -> list[dict]:
    """Shared memory per block of the decode MoE kernel's GPU build (limit at 1 byte) per
    ``DecodeBlocks`` spec, dtype and shared form."""
    from pallas_kernels.moe.decode import DecodeBlocks, routed_experts_decode

    one = h200_sharding(1)
    sd = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=one)
    rows = []
    for spec in specs:
        bl = parse_blocks([spec], DecodeBlocks)[0]
        for dtype in dtypes:
            for shared in SHARED_FORMS:
                args, sh = moe_args(sd, jnp.dtype(dtype), m, shared)
                fn = lambda *a, bl=bl: routed_experts_decode(*a, blocks=bl)
                need = _compile_error(fn, (*args, sh))
                row = dict(spec=spec, kernel="moe_decode", tokens=m, dtype=jnp.dtype(dtype).name)
                row.update(shared=shared, xla_shared_B=need, fits=need <= GPU_SMEM_LIMIT)
                rows.append(row)
    return rows


def moe_route_rows(dtypes, tokens) -> list[dict]:
    """Whether ``routed_experts(impl="pallas")`` (the blocks its route picks) compiles for the
    H200 within its shared memory, per dtype, token count and shared form (a shared term at
    up to 16 tokens, as decode and small verify batches pass it)."""
    from gdn_jax.moe import routed_experts

    h200 = h200_sharding(GPU_SMEM_LIMIT)
    sd = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=h200)
    rows = []
    for dtype in dtypes:
        for m in tokens:
            for shared in SHARED_FORMS if m <= 16 else ("none",):
                args, sh = moe_args(sd, jnp.dtype(dtype), m, shared)
                fn = lambda *a: routed_experts(*a[:6], shared=a[6], impl="pallas")
                need = _compile_error(fn, (*args, sh))
                row = dict(spec="route", kernel="routed_experts", tokens=m)
                row.update(dtype=jnp.dtype(dtype).name, shared=shared, xla_shared_B=need)
                rows.append(dict(row, fits=need is None))
    return rows


# the H200's shared memory per block (sm_90's opt-in limit, 227 KiB)
GPU_SMEM_LIMIT = 232448


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.compile_report",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    a = p.add_argument
    a("specs", nargs="*", default=[""], help="VerifyBlocks / ChunkBlocks specs ('' = defaults)")
    a(
        "--kernel",
        choices=("verify", "arena", "commit", "chunk", "moe_decode", "moe_routes"),
        default="verify",
        help="moe_decode: the decode MoE kernel's shared memory (as --xla) per DecodeBlocks "
        "spec, dtype and shared term; moe_routes: routed_experts(impl='pallas') at every "
        "token count of --tokens-list, whether its build fits the H200",
    )
    a(
        "--tokens-list",
        default=None,
        help="moe_decode, moe_routes: token counts (default 1,2 and 1,2,16,64,65,464,1100)",
    )
    a("--dtypes", default="bfloat16,float16,float32", help="moe_decode, moe_routes: dtypes")
    a("--tokens", type=int, default=256, help="chunk: T (tokens per sequence)")
    a("--batch", type=int, default=16)
    a("--hv", type=int, default=32)
    a("--nodes", type=int, default=64, help="verify: N (draft nodes)")
    a("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="verify: q/k/v dtype")
    a("--k", type=int, default=128, help="verify, commit: key head dim")
    a("--v", type=int, default=128, help="verify, commit: value head dim")
    a("--xla", action="store_true", help="shared memory of jax's own GPU build (see above)")
    a("--triton-path", default="/tmp/tri", help="where Triton is installed")
    a("--json", default="", help="also write the rows here (after each kernel)")
    args = p.parse_args(argv)
    if args.kernel in ("moe_decode", "moe_routes"):
        dtypes = args.dtypes.split(",")
        default = "1,2" if args.kernel == "moe_decode" else "1,2,16,64,65,464,1100"
        tokens = [int(t) for t in (args.tokens_list or default).split(",")]
        if args.kernel == "moe_decode":
            rows = [r for m in tokens for r in moe_decode_rows(args.specs, dtypes, m)]
        else:
            rows = moe_route_rows(dtypes, tokens)
        write_json(args.json, rows)
        print(markdown_table([dict(r, spec=f"`{r['spec'] or 'default'}`") for r in rows], MOE_COLS))
        return rows
    if args.xla:
        if args.kernel == "chunk":
            sys.exit("--xla: verify, arena or commit")
        rows = []
        for spec in args.specs:
            rows.append(xla_row(args.kernel, spec, args))
            write_json(args.json, rows)
        print(markdown_table([dict(r, spec=f"`{r['spec'] or 'default'}`") for r in rows], XLA_COLS))
        return rows
    if args.kernel == "chunk":
        lowered = [lower_chunk(spec, args.batch, args.tokens, args.hv) for spec in args.specs]
        jobs = [
            (spec, name, ttir, warps, stages)
            for spec, (_, kernels) in zip(args.specs, lowered, strict=True)
            for name, ttir, warps, stages in kernels
        ]
        cols = CHUNK_COLS
    else:
        dtype = jnp.dtype(args.dtype)
        shape = (args.batch, args.hv, args.nodes, dtype, args.kernel, args.k, args.v)
        lowered = [lower_verify(spec, *shape) for spec in args.specs]
        jobs = [
            (spec, args.kernel, ttir, bl.num_warps, bl.num_stages)
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
