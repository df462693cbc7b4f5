"""Where does a verify call's time go? Times one jitted program that runs an op on R input sets
back to back (as ``benchmarks/kernels.py``'s ``timed_fused``) for several R and fits
``time = intercept + R * slope``: the slope is the device time per op (kernel plus launch gap),
the intercept the program's fixed cost (host dispatch, output allocation, synchronisation).

    python benchmarks/overhead_probe.py --configs "32:16:64;64:1:64" --json probe.json

Ops: the Pallas tree verify per ``--verify-blocks`` spec, the XLA tree verify, and a trivial
Pallas copy of the state over the same grid (the cost of any Pallas call of that grid).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import numpy as np
from jax.experimental import pallas as pl

import gdn_jax
import pallas_kernels as pk
from benchmarks.kernels import pallas_copy, parse_blocks, tree_inputs


def _tiny_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 1.0001


def pallas_tiny(s0):
    """One program copying one 8 x 128 tile of the state: the cost of launching a Pallas call."""
    spec = pl.BlockSpec((None, None, 8, 128), lambda i: (0, 0, 0, 0))
    return pl.pallas_call(
        _tiny_kernel, grid=(1,), in_specs=[spec],
        out_specs=pl.BlockSpec((8, 128), lambda i: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((8, 128), s0.dtype), name="tiny",
    )(s0)  # fmt: skip


def program_time(fn, sets, reps: int) -> float:
    f = jax.jit(lambda xs: [fn(*x) for x in xs])
    jax.block_until_ready(f(sets))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(sets))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def fit(rs, ts):
    slope, intercept = np.polyfit(np.asarray(rs, float), np.asarray(ts, float), 1)
    return float(slope), float(intercept)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--configs", default="32:16:64;64:1:64", help="'Hv:B:N' list")
    p.add_argument("--rs", default="1,2,4,8,16", help="numbers of input sets per program")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--verify-blocks", action="append", default=None,
                   help="VerifyBlocks spec, repeatable ('' = defaults)")  # fmt: skip
    p.add_argument("--ops", default="",
                   help="comma list of op names to run (default all: pallas[spec]..., xla, "
                        "pallas_copy, xla_copy, pallas_tiny, xla_tiny)")  # fmt: skip
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rs = [int(r) for r in args.rs.split(",")]
    specs = args.verify_blocks or [""]
    rows = []
    print(f"# device {jax.devices()[0].device_kind}; jax {jax.__version__}", file=sys.stderr)
    for cfg in args.configs.split(";"):
        hv, b, n = (int(x) for x in cfg.split(":"))
        sets = [tree_inputs(i, b, n, hv, chain=False) for i in range(max(rs))]
        ops = {}
        for spec in specs:
            bl = parse_blocks([spec], pk.VerifyBlocks)[0]
            ops[f"pallas[{spec}]"] = lambda *a, bl=bl: pk.tree_verify(
                *a, use_qk_l2norm=True, blocks=bl)  # fmt: skip
        ops["xla"] = lambda *a: gdn_jax.tree_verify(
            *a[:6], initial_state=a[6], use_qk_l2norm=True, impl="xla")  # fmt: skip
        ops["pallas_copy"] = lambda *a: pallas_copy(a[6])
        ops["xla_copy"] = lambda *a: a[6] * 1.0001
        ops["pallas_tiny"] = lambda *a: pallas_tiny(a[6])
        ops["xla_tiny"] = lambda *a: a[6][0, 0, :8] * 1.0001
        keep = set(filter(None, args.ops.split(",")))
        for name, fn in ops.items():
            if keep and name not in keep:
                continue
            try:
                ts = [program_time(fn, sets[:r], args.reps) for r in rs]
            except Exception as e:  # keep the other ops of the run
                print(f"# {cfg} {name} failed: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
                continue
            slope, intercept = fit(rs, ts)
            row = dict(Hv=hv, B=b, N=n, op=name, rs=rs, program_us=[1e6 * t for t in ts],
                       slope_us=1e6 * slope, intercept_us=1e6 * intercept)  # fmt: skip
            rows.append(row)
            prog = " ".join(f"{1e6 * t:.0f}" for t in ts)
            print(f"Hv={hv} B={b} N={n} {name:40s} per-op {1e6 * slope:8.1f} us  "
                  f"fixed {1e6 * intercept:8.1f} us  program(R={args.rs}) {prog}", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
