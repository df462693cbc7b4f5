"""Where does tree WY's greedy output leave plain greedy's, and is it a near tie?

    python -m benchmarks.diag_tree_divergence CONFIG.json [--prompts 16] [--tokens 32] \
        [--kernels xla]

Builds the model of an HF config with random float32 weights and runs the same prompts
(``serving.bench.stdlib_prompts``) through plain greedy decoding and tree-WY speculation
(n-gram drafting, tree 4,2,2). It prints the tree run's acceptance lengths and the number of
rows whose tokens differ. Then, for each differing row, one dense full-sequence forward over the
prompt plus plain's tokens (no cache, one program for all rows) gives the reference logits at
the first differing position. For that position it prints the reference top-3 tokens and
logits, and the reference logit of plain's token minus tree WY's. A gap near float rounding
means a near tie that another summation order can flip; a large gap means a bug.

For full f32 dots everywhere set ``JAX_DEFAULT_MATMUL_PRECISION=highest`` (the model's own
matmuls are HIGHEST in f32 already). ``FORCE_DIFF=1`` treats every row as differing, to
exercise the reference path.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from serving.bench import stdlib_prompts
from serving.llm import LLM, load_model
from serving.params import SamplingParams, SpecConfig


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="HF config.json (random float32 weights at that size)")
    ap.add_argument("--prompts", type=int, default=16, help="requests = batch rows (16)")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per request (32)")
    ap.add_argument("--kernels", default="xla", choices=("xla", "auto", "pallas"))
    args = ap.parse_args(argv)
    if args.prompts < 1 or args.tokens < 1:
        ap.error("--prompts and --tokens must be positive")
    t0 = time.time()
    model = load_model(args.config, jnp.float32)
    prompts = [[t % model.config.vocab_size for t in p] for p in stdlib_prompts(args.prompts, 96)]
    engine = dict(max_num_seqs=args.prompts, batch_buckets=(args.prompts,),
                  max_model_len=96 + args.tokens + 16, prefill_chunk=64, dtype="float32",
                  kernels=args.kernels)
    res = {}
    for name, spec in (("plain", None),
                       ("tree_wy", SpecConfig(method="ngram", tree=(4, 2, 2), verify="wy"))):
        outs = LLM(model, speculative=spec, **engine).generate(
            prompts, SamplingParams(max_tokens=args.tokens))
        res[name] = ([list(o.token_ids) for o in outs],
                     [list(o.metrics.get("acceptance_lengths") or []) for o in outs])
        print(name, "done", round(time.time() - t0, 1), "s", flush=True)
    acc = [a for row in res["tree_wy"][1] for a in row]
    print("tree_wy acceptance: mean", np.mean(acc), "max", max(acc), "steps", len(acc), flush=True)
    plain, wy = res["plain"][0], res["tree_wy"][0]
    diff = [i for i, (a, b) in enumerate(zip(plain, wy, strict=True)) if a != b or os.environ.get("FORCE_DIFF")]
    print("rows differing:", len(diff), "of", args.prompts, flush=True)
    rows = []
    if diff:
        full = jnp.asarray([prompts[i] + plain[i] for i in diff], jnp.int32)
        logits = np.asarray(jax.jit(lambda ids: model(ids))(full), np.float64)
        for r, i in enumerate(diff):
            a, b = plain[i], wy[i]
            j = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
            lg = logits[r, len(prompts[i]) + j - 1]
            top = np.argsort(lg)[::-1][:3]
            both = j < min(len(a), len(b))
            row = dict(
                row=i, pos=j, plain_tok=a[j] if j < len(a) else None,
                wy_tok=b[j] if j < len(b) else None, dense_top=[int(t) for t in top],
                dense_top_logits=[float(lg[t]) for t in top],
                gap_plain_minus_wy=float(lg[a[j]] - lg[b[j]]) if both else None,
                logit_std=float(np.std(lg)), wy_accepts_before=res["tree_wy"][1][i][:8])
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main()
