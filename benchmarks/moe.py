"""The routed MoE block (gate/up, SiLU, down, weighted combine over the top-k) on one GPU: the
XLA path (``lax.ragged_dot``), jax's Mosaic GPU ``ragged_dot_mgpu``, and the Triton kernels of
``pallas_kernels.moe`` (decode, small-M and grouped), each against the floor.

Shapes: ``M`` tokens (``--m``), ``E`` experts (``--experts``), top-``k`` (``--top-k``), hidden
``H`` (``--hidden``), expert intermediate ``I`` (``--inter``), ``--dtype`` (default: the
Qwen3.5-35B-A3B MoE, E 256, k 8, H 2048, I 512, bf16). Inputs: ``--sets`` fresh random input
sets per ``M`` (``x ~ N(0, 1)``; routing = softmax of random logits, top-k, renormalised, as the
model's router); ``--weight-copies`` copies of the expert weights (default: one per input set),
set ``s`` reading copy ``s mod copies``, so that each op reads weights that no earlier op of
the program left in the GPU's L2 cache, as the layers of a model step do (``1``: every set
reads one copy, and a small-``M`` op can find its experts' weights cached).

Timing: one jitted program runs the op on every set back to back (as the layers of a model
step); the time per op is the marginal cost ``(t(R) - t(1)) / (R - 1)`` for ``R = --sets >= 4``
(else ``t(R) / R``), medians over ``--reps`` runs after a warm-up run, each run ended by
``jax.block_until_ready``. ``call_us`` is one jitted call end to end (dispatch and sync
included). ``--profile`` adds each op's kernel time from a profiler trace of the program
(``busy_us``: the summed durations of its kernels over the sets; at small ``M`` the marginal
time is noisier than the op itself).

Floor: ``max(bytes / copy rate, flops / matmul rate)``, with ``bytes`` = the touched experts'
weights (``3 H I`` elements each, distinct experts of the set's routing, averaged over the sets)
+ ``x`` read + ``out`` written, ``flops = 2 * M * k * 3 H I``; the copy rate is ``2 * nbytes / t``
of an elementwise pass over 1 GiB of random f32 and the matmul rate a bf16 ``8192^3`` matmul, both measured at
the start of the run. Error: per path, the relative error against the XLA path on set 0
(``rel_err``: whole output; ``row_rel_err``: the worst token row).

``--shared-inter I_s`` adds a shared expert's down projection to every op, as the model's fused
MoE block passes it (``routed_experts(shared=)``): inside the decode kernels' launch, one matmul
after the other paths; its weight (``[H, I_s]``, one per weight copy) and activations count in
the floor.

Variants: ``--decode-blocks``, ``--decode-mgpu-blocks``, ``--small-blocks``,
``--grouped-blocks``, ``--mgpu-blocks`` (repeatable ``field=value,...`` specs of
``DecodeBlocks``, ``MgpuDecodeBlocks``, ``SmallMBlocks``, ``GroupedBlocks``, ``MgpuBlocks``).
``decode_mgpu`` is the decode kernel's Mosaic GPU version (2-byte weights, up to 8 tokens, ``I``
a multiple of 64 and ``H`` of 128). A failing
path is recorded in its row (``error``) and the run goes on.

    python -m benchmarks.moe --json moe.json                      # the H200 run
    python -m benchmarks.moe --m 1,16 --small-blocks "" --small-blocks block_i=64,num_warps=8
    python -m benchmarks.moe --dry-run                            # tiny shapes, CPU, interpret
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels.moe as moe  # noqa: E402
from benchmarks.common import ints, log, markdown_table, parse_blocks, write_json  # noqa: E402
from benchmarks.kernel_profile import profile as profile_kernels  # noqa: E402
from benchmarks.timing import measure_bandwidth, measure_matmul  # noqa: E402
from gdn_jax.moe import routed_experts, shared_term  # noqa: E402

PATHS = ("xla", "mgpu", "decode", "decode_mgpu", "small_m", "grouped")
DRY = dict(m=[1, 4], experts=8, top_k=2, hidden=32, inter=16, reps=2, sets=2)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--m", type=ints, default=[1, 16, 464, 2048, 8192], help="tokens per call")
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=512)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument(
        "--shared-inter",
        type=int,
        default=0,
        help="a shared expert of this intermediate size whose down projection each op adds "
        "(as the model's fused MoE block passes it: in the decode kernel's launch, one matmul "
        "after the other paths); 0: none",
    )
    p.add_argument("--paths", default=",".join(PATHS), help=f"comma list of {PATHS}")
    p.add_argument("--reps", type=int, default=10, help="timed runs per program (median)")
    p.add_argument("--sets", type=int, default=4, help="input sets per M (one program)")
    p.add_argument(
        "--weight-copies",
        type=int,
        default=0,
        help="copies of the expert weights, read in turn by the sets (default 0: one per set)",
    )
    p.add_argument(
        "--max-call-ms",
        type=float,
        default=400.0,
        help="skip a path at larger M once one call took longer than this",
    )
    p.add_argument("--decode-blocks", action="append", default=[], help="DecodeBlocks spec")
    p.add_argument("--small-blocks", action="append", default=[], help="SmallMBlocks spec")
    p.add_argument("--grouped-blocks", action="append", default=[], help="GroupedBlocks spec")
    p.add_argument("--mgpu-blocks", action="append", default=[], help="MgpuBlocks spec")
    p.add_argument(
        "--decode-mgpu-blocks", action="append", default=[], help="MgpuDecodeBlocks spec"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--profile",
        action="store_true",
        help="also each op's kernel time from a profiler trace (busy us: the kernels alone, "
        "no dispatch or timing noise; benchmarks.kernel_profile)",
    )
    p.add_argument("--json", default="", help="write the rows and measured rates here")
    p.add_argument(
        "--dry-run", action="store_true", help="tiny shapes on CPU, kernels in interpret mode"
    )
    args = p.parse_args(argv)
    if args.weight_copies < 0:
        p.error("--weight-copies: at least 0 (0: one per input set)")
    if args.shared_inter < 0:
        p.error("--shared-inter: at least 0 (0: no shared expert)")
    if args.dry_run:  # tiny shapes, but the ones given on the command line kept
        for key, val in DRY.items():
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, val)
    args.paths = [x for x in args.paths.split(",") if x]
    bad = sorted(set(args.paths) - set(PATHS))
    if bad:
        p.error(f"--paths: unknown {bad}; choose from {PATHS}")
    return args


# --------------------------------------------------------------------------------------- timing


def program(fn):
    """One jitted program running ``fn`` on every input set of a list back to back."""
    return jax.jit(lambda xs: [fn(*s) for s in xs])


def program_seconds(f, sets, reps: int) -> float:
    """Median seconds of the program ``f`` on ``sets`` (one warm-up run first)."""
    jax.block_until_ready(f(sets))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(sets))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def per_op_us(f, sets, reps: int) -> tuple[float, float]:
    """``(marginal us per op over the sets, us of the program on one set)``."""
    r = len(sets)
    t_1 = program_seconds(f, sets[:1], reps)
    if r < 4:
        return 1e6 * program_seconds(f, sets, reps) / r, 1e6 * t_1
    t_r = program_seconds(f, sets, reps)
    return 1e6 * max(t_r - t_1, 0.0) / (r - 1), 1e6 * t_1


# --------------------------------------------------------------------------------------- inputs


def expert_weights(args, dtype, copy: int = 0):
    """``gate, up [E, H, I]``, ``down [E, I, H]`` ~ N(0, 1) / sqrt(fan-in) (``copy``: which of
    the ``--weight-copies``)."""
    keys = jax.random.split(jax.random.fold_in(jax.random.key(args.seed), copy), 4)
    e, h, i = args.experts, args.hidden, args.inter
    out = (
        (jax.random.normal(keys[0], (e, h, i), jnp.float32) / h**0.5).astype(dtype),
        (jax.random.normal(keys[1], (e, h, i), jnp.float32) / h**0.5).astype(dtype),
        (jax.random.normal(keys[2], (e, i, h), jnp.float32) / i**0.5).astype(dtype),
    )
    if args.shared_inter:  # the shared expert's down projection, [H, I_s] (a linear layer's)
        w_s = jax.random.normal(keys[3], (h, args.shared_inter), jnp.float32)
        out += ((w_s / args.shared_inter**0.5).astype(dtype),)
    return out


def input_sets(args, m: int, dtype) -> list[tuple]:
    """``--sets`` fresh ``(x, weights, experts[, h_s])``: softmax top-k routing of random
    logits (and the shared expert's activation ``h_s [M, I_s]`` with ``--shared-inter``)."""
    out = []
    for s in range(args.sets):
        kx, kl, ks = jax.random.split(jax.random.key(1000 * m + s + args.seed), 3)
        x = jax.random.normal(kx, (m, args.hidden), jnp.float32).astype(dtype)
        probs = jax.nn.softmax(jax.random.normal(kl, (m, args.experts), jnp.float32), axis=-1)
        top_p, top_i = jax.lax.top_k(probs, args.top_k)
        top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
        one = (x, top_p.astype(dtype), top_i.astype(jnp.int32))
        if args.shared_inter:
            one += (jax.random.normal(ks, (m, args.shared_inter), jnp.float32).astype(dtype),)
        out.append(one)
    return out


# ---------------------------------------------------------------------------------------- paths


def with_shared(path: str, fn):
    """``fn`` taking a set's ``(x, w, e, h_s, gate, up, down, w_s)`` (``--shared-inter``): the
    decode kernels run the shared term in their launch, the other paths add it after."""
    if path in ("decode", "decode_mgpu"):

        def wrapped(x, w, e, h_s, g, u, d, w_s):
            return fn(x, w, e, g, u, d, (h_s, w_s))
    else:

        def wrapped(x, w, e, h_s, g, u, d, w_s):
            return fn(x, w, e, g, u, d) + shared_term(h_s, w_s, g.dtype)

    wrapped.keywords = getattr(fn, "keywords", {})  # the knobs, as skip_reason reads them
    return wrapped


def variants(args, interpret: bool) -> list[tuple[str, str, object]]:
    """``(path, variant label, fn(*set))`` of every path and knob spec; a set is ``(x, w, e,
    gate, up, down)``, with ``--shared-inter`` ``(x, w, e, h_s, gate, up, down, w_s)``."""
    out = _variants(args, interpret)
    if args.shared_inter:
        out = [(path, var, with_shared(path, fn)) for path, var, fn in out]
    return out


def _variants(args, interpret: bool) -> list[tuple[str, str, object]]:
    out = []
    for path in args.paths:
        if path == "xla":
            out.append(("xla", "lax.ragged_dot", functools.partial(routed_experts, impl="xla")))
        elif path == "mgpu":
            for bl in parse_blocks(args.mgpu_blocks, moe.MgpuBlocks):
                out.append(
                    ("mgpu", label(bl), functools.partial(moe.routed_experts_mgpu, blocks=bl))
                )
        elif path == "decode":
            for bl in parse_blocks(args.decode_blocks, moe.DecodeBlocks):
                fn = functools.partial(moe.routed_experts_decode, blocks=bl, interpret=interpret)
                out.append(("decode", label(bl), fn))
        elif path == "decode_mgpu":
            for bl in parse_blocks(args.decode_mgpu_blocks, moe.MgpuDecodeBlocks):
                fn = functools.partial(
                    moe.routed_experts_decode_mgpu, blocks=bl, interpret=interpret
                )
                out.append(("decode_mgpu", label(bl), fn))
        elif path == "small_m":
            for bl in parse_blocks(args.small_blocks, moe.SmallMBlocks):
                fn = functools.partial(moe.routed_experts_small_m, blocks=bl, interpret=interpret)
                out.append(("small_m", label(bl), fn))
        else:
            for bl in parse_blocks(args.grouped_blocks, moe.GroupedBlocks):
                fn = functools.partial(moe.routed_experts_grouped, blocks=bl, interpret=interpret)
                out.append(("grouped", label(bl), fn))
    return out


def label(blocks) -> str:
    """The fields of a knob dataclass that differ from its defaults (``default`` if none)."""
    base = type(blocks)()
    diff = [f"{k}={v}" for k, v in vars(blocks).items() if getattr(base, k) != v]
    return ",".join(diff) or "default"


def row_errors(out, ref) -> tuple[float, float]:
    """``(||out - ref|| / ||ref||, max over rows of the same per row)`` in float64."""
    a, b = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    per_row = np.linalg.norm(a - b, axis=1) / np.maximum(np.linalg.norm(b, axis=1), 1e-30)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b)), float(per_row.max())


def skip_reason(path: str, fn, m: int, args) -> str:
    """Why ``path`` cannot run at this ``M`` here (empty: it can)."""
    if path == "mgpu" and not moe.mgpu_available():
        return "needs a Hopper GPU (the benchmark times no interpret mode)"
    if path in ("decode", "small_m") and m * args.top_k > fn.keywords["blocks"].max_pairs:
        return f"M * k > max_pairs = {fn.keywords['blocks'].max_pairs}"
    if path == "decode_mgpu":
        kw = fn.keywords
        dt = jnp.dtype(args.dtype)
        x = jax.ShapeDtypeStruct((m, args.hidden), dt)
        w = jax.ShapeDtypeStruct((m, args.top_k), dt)
        e = jax.ShapeDtypeStruct((m, args.top_k), jnp.int32)
        gate = jax.ShapeDtypeStruct((args.experts, args.hidden, args.inter), dt)
        down = jax.ShapeDtypeStruct((args.experts, args.inter, args.hidden), dt)
        try:
            moe.check_decode_mgpu(x, w, e, gate, gate, down, None, kw["blocks"], kw["interpret"])
        except ValueError as err:
            return str(err).split(": ", 1)[1]
    return ""


def bench_m(args, m, weights, paths, rates, slow: set) -> list[dict]:
    dtype = weights[0][0].dtype
    sets = [(*s, *weights[c % len(weights)]) for c, s in enumerate(input_sets(args, m, dtype))]
    n = m * args.top_k
    h, i = args.hidden, args.inter
    touched = float(np.mean([len(np.unique(np.asarray(s[2]))) for s in sets]))
    size = jnp.dtype(dtype).itemsize
    nbytes = touched * 3 * h * i * size + 2 * m * h * size
    flops = 2.0 * n * 3 * h * i
    if args.shared_inter:  # w_s and h_s read
        nbytes += (h + m) * args.shared_inter * size
        flops += 2.0 * m * h * args.shared_inter
    floor_bw, floor_mm = nbytes / rates["copy_Bps"], flops / rates["matmul_flops"]
    floor_us = 1e6 * max(floor_bw, floor_mm)
    base = dict(
        m=m,
        pairs=n,
        touched=touched,
        bytes=nbytes,
        flops=flops,
        floor_us=floor_us,
        bound="bandwidth" if floor_bw >= floor_mm else "compute",
    )
    ref = None
    rows = []
    for path, var, fn in paths:
        row = dict(base, path=path, variant=var)
        rows.append(row)
        reason = skip_reason(path, fn, m, args) or (
            f"a call at smaller M took over {args.max_call_ms} ms" if (path, var) in slow else ""
        )
        if reason:
            row["skipped"] = reason
            continue
        t0 = time.perf_counter()
        try:
            f = program(fn)
            out = jax.block_until_ready(f(sets[:1])[0])  # compiles the one-set program
            if path == "xla":
                ref = out
            if ref is not None:
                row["rel_err"], row["row_rel_err"] = row_errors(out, ref)
            row["us"], row["call_us"] = per_op_us(f, sets, args.reps)
            row["x_floor"] = row["us"] / floor_us
            if args.profile:
                prof = profile_kernels(
                    functools.partial(f, sets), jax.block_until_ready, calls=3, top=6
                )
                if prof.get("busy_ms") is not None:
                    row["busy_us"] = 1e3 * prof["busy_ms"] / len(sets)
                    row["kernels"] = prof["kernels"] / len(sets)
                    row["busy_x_floor"] = row["busy_us"] / floor_us
                    row["top"] = prof["top"]
            row["GBps"] = nbytes / row["us"] / 1e3
            row["TFLOPs"] = flops / row["us"] / 1e6
            if row["call_us"] > 1e3 * args.max_call_ms:
                slow.add((path, var))
        except Exception as ex:  # keep the run going; the row says what failed
            row["error"] = f"{type(ex).__name__}: {str(ex)[:300]}"
        took = time.perf_counter() - t0
        result = f"{row['us']:.1f} us" if "us" in row else row.get("error")
        log(f"M {m} {path} [{var}]: {result} ({took:.0f} s)")
    return rows


COLS = [
    ("m", "M"),
    ("path", "path"),
    ("variant", "variant"),
    ("touched", "experts touched"),
    ("us", "us / op"),
    ("call_us", "us / call"),
    ("floor_us", "floor us"),
    ("bound", "bound"),
    ("x_floor", "x floor"),
    ("busy_us", "busy us / op"),
    ("busy_x_floor", "busy x floor"),
    ("kernels", "kernels / op"),
    ("GBps", "GB/s"),
    ("TFLOPs", "TFLOP/s"),
    ("rel_err", "rel err vs XLA"),
    ("row_rel_err", "worst row"),
    ("skipped", "skipped"),
    ("error", "error"),
]


def report(args, rates, rows) -> dict:
    """The JSON document of a run."""
    return dict(
        device=jax.devices()[0].device_kind,
        backend=jax.default_backend(),
        jax=jax.__version__,
        argv=sys.argv[1:],
        rates=rates,
        config={k: v for k, v in vars(args).items() if k != "json"},
        rows=rows,
    )


def main(argv=None) -> None:
    args = parse_args(argv)
    interpret = jax.default_backend() == "cpu"
    if interpret and not args.dry_run:
        log("CPU backend: the Triton kernels run in interpret mode (slow); see --dry-run")
    dtype = jnp.dtype(args.dtype)
    rates = dict(
        copy_Bps=measure_bandwidth(args.reps, 1 << 20 if args.dry_run else 256 << 20),
        matmul_flops=measure_matmul(args.reps, 256 if args.dry_run else 8192),
    )
    tbps, tflops = rates["copy_Bps"] / 1e12, rates["matmul_flops"] / 1e12
    log(f"copy {tbps:.2f} TB/s, bf16 matmul {tflops:.0f} TFLOP/s")
    copies = args.weight_copies or args.sets
    weights = [expert_weights(args, dtype, c) for c in range(copies)]
    paths = variants(args, interpret)
    rows, slow = [], set()
    for m in args.m:
        rows += bench_m(args, m, weights, paths, rates, slow)
        write_json(args.json, report(args, rates, rows))  # after each M: a cut run keeps its rows
    print(markdown_table(rows, COLS))
    print(
        f"\nE {args.experts}, k {args.top_k}, H {args.hidden}, I {args.inter}, {args.dtype}; "
        f"copy {rates['copy_Bps'] / 1e12:.2f} TB/s, matmul {rates['matmul_flops'] / 1e12:.0f} "
        f"TFLOP/s; {jax.devices()[0].device_kind}"
    )


if __name__ == "__main__":
    main()
