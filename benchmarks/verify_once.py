"""Runs the Pallas tree verify twice per ``VerifyBlocks`` spec at one shape, for a profiler.

    ncu --clock-control none -k regex:gdn_tree_verify python3 benchmarks/verify_once.py \
        "precision=bf16x3" "precision=bf16x3,stop_after=load"

Shape: ``--hv`` value heads (Hk 16), ``--batch``, ``--nodes``; K = V = 128, bf16 q/k/v, random
tree (the inputs of ``benchmarks/kernels.py``).
"""

from __future__ import annotations

import argparse

import jax

import pallas_kernels as pk
from benchmarks.kernels import parse_blocks, tree_inputs


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("specs", nargs="*", default=[""], help="VerifyBlocks specs ('' = defaults)")
    p.add_argument("--hv", type=int, default=32)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--nodes", type=int, default=64)
    p.add_argument(
        "--fused", type=int, default=0,
        help="run the op on this many input sets inside one jitted program (as timed_fused)",
    )  # fmt: skip
    args = p.parse_args(argv)
    # Inputs made on the host's CPU device and copied over, so that every GPU kernel a profiler
    # sees belongs to the verify program.
    with jax.default_device(jax.devices("cpu")[0]):
        sets = [tree_inputs(i, args.batch, args.nodes, args.hv, chain=False)
                for i in range(max(args.fused, 1))]  # fmt: skip
    sets = jax.device_put(sets, jax.devices()[0])
    for spec in args.specs:
        bl = parse_blocks([spec], pk.VerifyBlocks)[0]
        op = lambda *a, bl=bl: pk.tree_verify(*a, use_qk_l2norm=True, blocks=bl)
        if args.fused:
            f = jax.jit(lambda xs, op=op: [op(*x) for x in xs])
            run = lambda f=f: f(sets)
        else:
            f = jax.jit(op)
            run = lambda f=f: f(*sets[0])
        for _ in range(2):
            jax.block_until_ready(run())
        print(f"ran {spec!r}", flush=True)


if __name__ == "__main__":
    main()
