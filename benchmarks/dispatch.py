"""What one call of a jitted program costs the host, against its number of array arguments.

    python -m benchmarks.dispatch [--args 1,64,256,753,1500] [--reps 200] [--json out.json]

A serving step passes the model's weights as arguments (753 arrays for Qwen3.5-35B-A3B's 40
layers), and the runtime handles each argument buffer on every call. Each row jits one program
that reads every argument (one element of each, summed into a ``[256, 256]`` matmul so the
device has some work) and is compiled the way the engine compiles its steps (one CUDA graph,
the GPU's exclusive lock: :mod:`serving.launch`). It reports the median time until the call
returns (``dispatch us``), until its output is ready (``call us``), and the dispatch per
argument over the one-argument program. Arguments are 1 KiB arrays, resident on the device.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import ints, log, markdown_table, write_json
from serving import launch


def program(n: int):
    """A jitted function of ``n`` device arrays plus a ``[256, 256]`` matrix."""

    def fn(leaves, m):
        s = sum(leaf[0] for leaf in leaves)
        return m @ m + s

    return launch.jit(fn)


def time_call(fn, args, reps: int) -> tuple[float, float]:
    """Median microseconds until ``fn(*args)`` returns and until its output is ready; each call
    starts after the previous one's output was released."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    ds, ts = [], []
    for _ in range(reps):
        t = time.perf_counter()
        out = fn(*args)
        ds.append(1e6 * (time.perf_counter() - t))
        jax.block_until_ready(out)
        ts.append(1e6 * (time.perf_counter() - t))
        del out
    return float(np.median(ds)), float(np.median(ts))


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.dispatch",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--args", type=ints, default=[1, 64, 256, 753, 1500], help="argument counts")
    ap.add_argument("--reps", type=int, default=200, help="timed calls per row")
    ap.add_argument("--json", metavar="PATH", help="also write the results here")
    args = ap.parse_args(argv)
    if min(args.args) < 1 or args.reps < 1:
        ap.error("--args and --reps must be positive")
    m = jnp.ones((256, 256), jnp.float32)
    rows = []
    for n in args.args:
        leaves = [jnp.full((256,), i, jnp.float32) for i in range(n)]
        dispatch, call = time_call(program(n), (leaves, m), args.reps)
        rows.append(dict(args=n, dispatch_us=dispatch, call_us=call))
        log(f"{n} arguments: dispatch {dispatch:.1f} us, call {call:.1f} us")
    base = rows[0]
    for r in rows:
        extra = r["args"] - base["args"]
        r["us_per_arg"] = (r["dispatch_us"] - base["dispatch_us"]) / extra if extra else None
    device = jax.devices()[0].device_kind
    print(f"\n{device}: one jitted call by its number of array arguments\n")
    cols = [
        ("args", "arguments"),
        ("dispatch_us", "dispatch us"),
        ("call_us", "call us"),
        ("us_per_arg", "dispatch us per extra argument"),
    ]
    print(markdown_table(rows, cols, digits=4))
    if args.json:
        write_json(args.json, dict(benchmark="dispatch", device=device, rows=rows))
    return rows


if __name__ == "__main__":
    main()
