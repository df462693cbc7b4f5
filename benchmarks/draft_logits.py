"""Drafting program: the draft model's transient verify (logits, argmax, hidden states and the
tree state, all written out) against ``tree_logits`` (logits alone), side by side.

    python -m benchmarks.draft_logits [--kernels xla|auto] [--batch 8] [--reps 50] [--json out.json]

The shipped tiny target/draft pair (``serving/assets/tiny``) as ``python -m serving bench``
builds it (tree (4, 2, 2): 29 nodes, draft in the target's arena). Both programs run on the
same inputs (every row's state handle 0 and empty page tables: the shapes and the work of a
draft level, not a real batch's values), alternating, ``--reps`` times each after a warm-up;
the table gives the median and the bytes each program writes out.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
from jax import numpy as jnp

from benchmarks.common import write_json
from serving.bench import ASSETS
from serving.llm import LLM, load_model
from serving.params import SpecConfig


def _nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.draft_logits", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--kernels", default="xla", choices=["xla", "auto", "pallas"])
    ap.add_argument("--batch", type=int, default=8, help="rows (the bench's max_num_seqs)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if args.batch < 1 or args.reps < 1:
        ap.error("--batch and --reps must be positive")
    dtype = jnp.dtype(args.dtype)
    model, draft = load_model(ASSETS / "target", dtype), load_model(ASSETS / "draft", dtype)
    spec = SpecConfig(method="draft_model", draft_model=draft, tree=(4, 2, 2), verify="wy")
    llm = LLM(
        model,
        speculative=spec,
        max_num_seqs=args.batch,
        batch_buckets=(args.batch,),
        max_model_len=176,
        prefill_chunk=64,
        dtype=args.dtype,
        kernels=args.kernels,
    )
    r = llm.engine.draft_runner
    b, n, mp = args.batch, spec.num_nodes, llm.scheduler.pages_per_seq
    rows = (np.zeros(b, np.int32), np.zeros((b, mp), np.int32), np.zeros(b, np.int32))
    tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, (b, n), np.int32)
    parents, frontier = [-1], [0]  # the full (4, 2, 2) tree, level by level
    for width in spec.tree:
        start = len(parents)
        parents += [p for p in frontier for _ in range(width)]
        frontier = list(range(start, len(parents)))
    assert len(parents) == n
    parents = np.tile(np.array(parents, np.int32), (b, 1))
    progs = {
        "transient verify": lambda: r.verify(*rows, tokens, parents),
        "tree_logits": lambda: r.tree_logits(*rows, tokens, parents),
    }
    out_bytes = {k: _nbytes(jax.block_until_ready(f())) for k, f in progs.items()}  # + warm-up
    times = {k: [] for k in progs}
    for _ in range(args.reps):
        for k, f in progs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f())
            times[k].append(time.perf_counter() - t0)
    med = {k: float(np.median(v)) for k, v in times.items()}
    print(
        f"draft level, {r.kind} draft runner, kernels {r.kernels}, B {b}, N {n}, "
        f"{jax.devices()[0].platform}, median of {args.reps}"
    )
    print("| program | us | output bytes |")
    print("|---|---|---|")
    for k in progs:
        print(f"| {k} | {med[k] * 1e6:.1f} | {out_bytes[k]} |")
    ratio = med["tree_logits"] / med["transient verify"]
    print(f"tree_logits / transient verify: x{ratio:.3f}")
    res = dict(kernels=r.kernels, batch=b, nodes=n, device=str(jax.devices()[0]), median_s=med)
    res.update(output_bytes=out_bytes, ratio=ratio, times_s=times)
    write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
