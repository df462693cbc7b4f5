"""The engine's decode step with fused input projections against unfused, interleaved in one run.

    python -m benchmarks.fused_projections [--config qwen3_5_35b_a3b] [--layers L]
                                           [--batch 1,16] [--rounds 6] [--json out.json]
    python -m benchmarks.fused_projections --smoke   # tiny dims, CPU

One model (random bf16 weights built on the device, MoE rows spread by
``gdn_jax.moe.balanced_route``) served by two engines that differ only in
``LLM(fuse_projections=...)`` (:mod:`gdn_jax.models.fused`: a block's projections of one input
as one matmul), each with its own arena. For each batch size both engines prefill their rows
(``--context`` random tokens), then ``--rounds`` rounds alternate between them (the order
flips every round, so drift in the host or the GPU's clocks falls on both): each round times
``--reps`` decode steps one at a time (``ms``, and ``dispatch ms`` until the call returns) and
``--reps`` steps pipelined (each fed the previous step's argmax on the device, dispatched
before it ends; ``benchmarks/model_step.py``). The table has each figure's median over the
rounds and the fused / unfused ratio; the JSON keeps every round.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.common import ints, log, markdown_table, write_json
from benchmarks.model_step import decode_rows, median_ms, model_config, pipelined_ms
from gdn_jax.models import set_moe_routing
from serving.llm import LLM, load_model

FIGURES = ("ms", "dispatch_ms", "pipelined_ms")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.fused_projections", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--config", default="qwen3_5_35b_a3b", help="config name or path")
    ap.add_argument("--layers", type=int, help="cut the model to this many layers")
    ap.add_argument("--batch", type=ints, default=[1, 16], help="decode batch sizes (1,16)")
    ap.add_argument("--context", type=int, default=96, help="tokens per row before decode (96)")
    ap.add_argument("--rounds", type=int, default=6, help="alternating rounds (default 6)")
    ap.add_argument("--reps", type=int, default=10, help="steps timed per round (default 10)")
    ap.add_argument(
        "--memory-budget",
        type=lambda x: int(float(x)),
        default=int(10e9),
        help="each engine's arena bytes (default 10e9)",
    )
    ap.add_argument("--smoke", action="store_true", help="tiny dims and sizes (CPU check)")
    ap.add_argument("--json", metavar="PATH", help="also write the results here")
    args = ap.parse_args(argv)
    if min(args.batch) < 1 or min(args.rounds, args.reps, args.context) < 1:
        ap.error("--batch, --rounds, --reps and --context must be positive")
    name, cfg = model_config(args.config, args.smoke)
    if args.smoke:
        args.batch, args.context, args.rounds, args.reps = [2], 24, 2, 2
        args.memory_budget = int(2e8)
    if args.layers:
        if args.layers < 1:
            ap.error(f"--layers must be positive, got {args.layers}")
        cfg["num_hidden_layers"] = args.layers
        cfg.pop("layer_types", None)
    t0 = time.perf_counter()
    model = load_model(cfg, jnp.bfloat16)
    set_moe_routing(model, "balanced")
    jax.block_until_ready(nnx.state(model))
    log(
        f"{name}: {model.config.num_hidden_layers} layers built in {time.perf_counter() - t0:.1f} s"
    )
    engines = {
        fuse: LLM(
            model,
            memory_budget=args.memory_budget,
            max_num_seqs=max(args.batch),
            batch_buckets=sorted(set(args.batch)),
            max_model_len=args.context + 64,
            prefill_chunk=128,
            dtype="bfloat16",
            kernels="auto",
            fuse_projections=fuse,
        )
        for fuse in (True, False)
    }
    layers = model.config.num_hidden_layers
    del model
    rng = np.random.default_rng(0)
    rows = []
    for b in args.batch:
        calls = {}
        for fuse, llm in engines.items():
            runner = llm.engine.runner
            handles, pages, lengths, release = decode_rows(llm, b, args.context, rng)
            last = rng.integers(1, llm.config.vocab_size, b).astype(np.int32)

            def block(out, runner=runner):
                jax.block_until_ready(out)
                jax.block_until_ready(runner.manager.arena.buffer)

            calls[fuse] = (runner, (handles, pages, lengths, last), block, release)
        rounds = {fuse: {k: [] for k in FIGURES} for fuse in engines}
        for r in range(args.rounds):
            for fuse in (True, False) if r % 2 == 0 else (False, True):
                runner, a, block, _ = calls[fuse]
                ms, dispatch = median_ms(functools.partial(runner.decode, *a), args.reps, block)
                piped = pipelined_ms(runner, *a, args.reps, block)
                for k, v in zip(FIGURES, (ms, dispatch, piped), strict=True):
                    rounds[fuse][k].append(v)
        for fuse in engines:
            calls[fuse][3]()
            med = {k: float(np.median(v)) for k, v in rounds[fuse].items()}
            arrays = len(jax.tree.leaves(nnx.state(engines[fuse].model, nnx.Param)))
            rows.append(dict(batch=b, fused=fuse, weight_arrays=arrays, **med, rounds=rounds[fuse]))
        fused, plain = rows[-2], rows[-1]
        for k in FIGURES:
            fused[f"{k}_ratio"] = fused[k] / plain[k]
        log(f"B {b}: fused {fused['ms']:.3f} ms, unfused {plain['ms']:.3f} ms")
    doc = dict(
        benchmark="fused_projections",
        config=name,
        layers=layers,
        device=jax.devices()[0].device_kind,
        args=vars(args),
        rows=rows,
    )
    print(f"\n{name}, {layers} layers, bf16, context {args.context}, {doc['device']}\n")
    cols = [("batch", "B"), ("fused", "fused"), ("weight_arrays", "weight arrays")]
    cols += [("ms", "ms"), ("dispatch_ms", "dispatch ms"), ("pipelined_ms", "ms, pipelined")]
    cols += [("ms_ratio", "ms / unfused"), ("pipelined_ms_ratio", "pipelined / unfused")]
    print(markdown_table(rows, cols, digits=4))
    if args.json:
        write_json(args.json, doc)
    return doc


if __name__ == "__main__":
    main()
