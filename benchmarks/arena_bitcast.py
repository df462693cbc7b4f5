"""What reading a state slot through the arena's bitcast view costs, on this host's device.

A decode-like consumer (``out = S^T q`` per layer and head, plus the conv state's dot with a
kernel) runs jitted on (a) the slot's fields read through :func:`serving.memory.view` from the
``uint32`` arena via the handle table (table lookup, ``dynamic_slice`` of words, bitcast to
f32 / bf16), and (b) native arrays of the same shapes and dtypes (f32 recurrent state, bf16
conv state). Both get the same random contents and must agree to float rounding (XLA may fuse
the two differently). Reported: the median of ``--reps`` timed calls of each after a warm-up,
and (a) / (b), what the bitcast view costs.

The slot is one ``state`` unit of the memory study's scaled layout of ``--config`` (its first
4 layers, 32-token pages, 8 speculative nodes; configs in ``benchmarks.memory_trace``).

    python -m benchmarks.arena_bitcast
    python -m benchmarks.arena_bitcast --config qwen3.5-397b --reps 20 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np
from jax import numpy as jnp

from benchmarks.memory_trace.workload import CONFIGS
from serving.memory import MemoryManager, layout_for, view


def bitcast_cost(config: str = "qwen3.5-35b", reps: int = 50, seed: int = 0) -> dict:
    """Median seconds of the consumer through the view and on native arrays (see the module
    docstring), and their ratio."""
    layout = layout_for(CONFIGS[config]["config"], 32, num_layers=4, spec_nodes=8)
    mm = MemoryManager(layout, 4 * layout.state_slot_bytes, "avmp")
    rng = np.random.default_rng(seed)
    fields = {f.name: f for f in layout.fields("state")}
    rec, conv = fields["recurrent"], fields["conv"]
    h = mm.alloc("r", "state", 1)[0]
    native = {
        "recurrent": jnp.asarray(rng.standard_normal(rec.shape, np.float32)),
        "conv": jnp.asarray(rng.standard_normal(conv.shape, np.float32), conv.dtype),
    }
    for name, value in native.items():
        mm.write("state", h, value, field=name)
    q = jnp.asarray(rng.standard_normal(rec.shape[1:3], np.float32))
    w = jnp.asarray(rng.standard_normal(conv.shape[1:], np.float32), conv.dtype)

    def consume(s, c):
        return (
            jnp.einsum("lhkv,hk->lhv", s, q),
            jnp.sum(c.astype(jnp.float32) * w.astype(jnp.float32), axis=1),
        )

    @jax.jit
    def through_view(buf, table, handle):
        return consume(view(buf, table, handle, rec), view(buf, table, handle, conv))

    direct = jax.jit(consume)
    table, handle = mm.device_table(), jnp.int32(h)
    for a, b in zip(
        through_view(mm.arena.buffer, table, handle),
        direct(native["recurrent"], native["conv"]),
        strict=True,
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)

    def median_s(fn, *args):
        jax.block_until_ready(fn(*args))
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    t_view = median_s(through_view, mm.arena.buffer, table, handle)
    t_native = median_s(direct, native["recurrent"], native["conv"])
    return {
        "config": config,
        "device": str(jax.devices()[0]),
        "reps": reps,
        "state_slot_bytes": layout.state_slot_bytes,
        "recurrent_shape": list(rec.shape),
        "conv_shape": list(conv.shape),
        "view_s": t_view,
        "native_s": t_native,
        "ratio_view_over_native": t_view / t_native,
    }


def print_table(res: dict) -> None:
    print("| config | device | slot MB | through view ms | native ms | view / native |")
    print("|---|---|---|---|---|---|")
    print(
        f"| {res['config']} | {res['device']} | {res['state_slot_bytes'] / 1e6:.1f} "
        f"| {res['view_s'] * 1e3:.2f} | {res['native_s'] * 1e3:.2f} "
        f"| {res['ratio_view_over_native']:.2f} |"
    )


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.arena_bitcast",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--config",
        choices=sorted(CONFIGS),
        default="qwen3.5-35b",
        help="model whose scaled state slot is read (default: qwen3.5-35b)",
    )
    ap.add_argument("--reps", type=int, default=50, help="timed calls of each (default 50)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random contents")
    ap.add_argument("--json", metavar="PATH", help="write the result here")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error(f"--reps must be a positive int, got {args.reps}")
    res = bitcast_cost(args.config, args.reps, args.seed)
    print_table(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
