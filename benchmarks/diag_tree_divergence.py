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

``--dense-row R`` runs no engine: it decodes prompt ``R`` greedily with the dense forward alone
(no cache) and prints, per generated position, the token, its top-2 logit gap and the smallest
relative top-k margin of the MoE routers (``(p_k - p_{k+1}) / p_k`` over layers) on the tokens
so far. Then it repeats the last forward twice, once at another padded length (another
summation order) and then with the router inputs perturbed by relative noise, and
prints the largest logit change and the top-2 tokens at the last position: how far float-level
noise moves the logits there (noise at 1e-6, 1e-5 and 1e-4).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from serving.bench import stdlib_prompts
from serving.llm import LLM, load_model
from serving.params import SamplingParams, SpecConfig


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="HF config.json (random float32 weights at that size)")
    ap.add_argument("--prompts", type=int, default=16, help="requests = batch rows (16)")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per request (32)")
    ap.add_argument("--kernels", default="xla", choices=("xla", "auto", "pallas"))
    ap.add_argument(
        "--dense-row",
        type=int,
        default=None,
        metavar="R",
        help="no engine: dense greedy decoding of prompt R with router margins",
    )
    args = ap.parse_args(argv)
    if args.prompts < 1 or args.tokens < 1:
        ap.error("--prompts and --tokens must be positive")
    if args.dense_row is not None and not 0 <= args.dense_row < args.prompts:
        ap.error(f"--dense-row must be in [0, {args.prompts}), got {args.dense_row}")
    t0 = time.time()
    model = load_model(args.config, jnp.float32)
    prompts = [[t % model.config.vocab_size for t in p] for p in stdlib_prompts(args.prompts, 96)]
    if args.dense_row is not None:
        return dense_greedy(model, prompts[args.dense_row], args.tokens)
    engine = dict(
        max_num_seqs=args.prompts,
        batch_buckets=(args.prompts,),
        max_model_len=96 + args.tokens + 16,
        prefill_chunk=64,
        dtype="float32",
        kernels=args.kernels,
    )
    res = {}
    for name, spec in (
        ("plain", None),
        ("tree_wy", SpecConfig(method="ngram", tree=(4, 2, 2), verify="wy")),
    ):
        outs = LLM(model, speculative=spec, **engine).generate(
            prompts, SamplingParams(max_tokens=args.tokens)
        )
        res[name] = (
            [list(o.token_ids) for o in outs],
            [list(o.metrics.get("acceptance_lengths") or []) for o in outs],
        )
        print(name, "done", round(time.time() - t0, 1), "s", flush=True)
    acc = [a for row in res["tree_wy"][1] for a in row]
    print("tree_wy acceptance: mean", np.mean(acc), "max", max(acc), "steps", len(acc), flush=True)
    plain, wy = res["plain"][0], res["tree_wy"][0]
    diff = [
        i
        for i, (a, b) in enumerate(zip(plain, wy, strict=True))
        if a != b or os.environ.get("FORCE_DIFF")
    ]
    print("rows differing:", len(diff), "of", args.prompts, flush=True)
    rows = []
    if diff:
        full = jnp.asarray([prompts[i] + plain[i] for i in diff], jnp.int32)
        # The weights go in as an argument: closed over, they became ~31 GB of constants baked
        # into the program at real dims, and lowering it ran past the H200 call's limit.
        graphdef, state = nnx.split(model)
        forward = jax.jit(lambda st, ids: nnx.merge(graphdef, st)(ids))
        logits = np.asarray(forward(state, full), np.float64)
        for r, i in enumerate(diff):
            a, b = plain[i], wy[i]
            j = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
            lg = logits[r, len(prompts[i]) + j - 1]
            top = np.argsort(lg)[::-1][:3]
            both = j < min(len(a), len(b))
            row = dict(
                row=i,
                pos=j,
                plain_tok=a[j] if j < len(a) else None,
                wy_tok=b[j] if j < len(b) else None,
                dense_top=[int(t) for t in top],
                dense_top_logits=[float(lg[t]) for t in top],
                gap_plain_minus_wy=float(lg[a[j]] - lg[b[j]]) if both else None,
                logit_std=float(np.std(lg)),
                wy_accepts_before=res["tree_wy"][1][i][:8],
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def dense_greedy(model, prompt: list[int], tokens: int) -> list[dict]:
    """Greedy decoding by dense forwards with the MoE routers' top-k margins (``--dense-row``)."""
    from gdn_jax.models.moe import SparseMoE

    margins: list[jax.Array] = []
    noise = {"scale": 0.0}
    route = SparseMoE.route

    def traced_route(self, x):
        if noise["scale"]:
            key = jax.random.key(len(margins))
            x = x * (1 + noise["scale"] * jax.random.normal(key, x.shape, x.dtype))
        probs = jax.nn.softmax(self.gate(x).astype(jnp.float32), axis=-1)
        top = jax.lax.top_k(probs, self.top_k + 1)[0]
        margins.append((top[:, -2] - top[:, -1]) / top[:, -2])
        return route(self, x)

    graphdef, state = nnx.split(model)

    def forward(st, ids):
        margins.clear()
        logits = nnx.merge(graphdef, st)(ids[None])[0]
        return logits, (jnp.stack(margins) if margins else jnp.ones((1, ids.shape[0])))

    SparseMoE.route = traced_route
    try:
        fwd = jax.jit(forward)
        pad = len(prompt) + tokens
        seq, rows = list(prompt), []
        for _ in range(tokens):
            n = len(seq)
            logits, marg = fwd(state, jnp.asarray(seq + [0] * (pad - n), jnp.int32))
            lg = np.asarray(logits[n - 1], np.float64)
            top = np.argsort(lg)[::-1][:2]
            m = np.asarray(marg[:, :n], np.float64).min(axis=0)
            row = dict(
                pos=n - len(prompt),
                token=int(top[0]),
                top2_gap=float(lg[top[0]] - lg[top[1]]),
                min_router_margin_last=float(m[-1]),
                min_router_margin_all=float(m.min()),
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
            seq.append(int(top[0]))
        # the same last forward at another padded length, then with perturbed router inputs
        n = len(seq) - 1
        base = np.asarray(fwd(state, jnp.asarray(seq[:n] + [0] * (pad - n), jnp.int32))[0][n - 1])
        # (new lambdas: jax.jit(forward) again would reuse the trace cached for ``forward``)
        other = np.asarray(
            jax.jit(lambda st, ids: forward(st, ids))(
                state, jnp.asarray(seq[:n] + [0] * (pad + 37 - n), jnp.int32)
            )[0][n - 1]
        )
        out = dict(
            last_pos=n - len(prompt),
            max_dlogit_other_padding=float(np.abs(other - base).max()),
            logit_std=float(base.std()),
            top2=[int(t) for t in np.argsort(base)[::-1][:2]],
        )
        for scale in (1e-6, 1e-5, 1e-4):
            noise["scale"] = scale
            noisy = np.asarray(
                jax.jit(lambda st, ids: forward(st, ids))(
                    state, jnp.asarray(seq[:n] + [0] * (pad - n), jnp.int32)
                )[0][n - 1]
            )
            out[f"router_noise_{scale:g}"] = dict(
                max_dlogit=float(np.abs(noisy - base).max()),
                top2=[int(t) for t in np.argsort(noisy)[::-1][:2]],
            )
        print(json.dumps(out), flush=True)
        return rows + [out]
    finally:
        SparseMoE.route = route


if __name__ == "__main__":
    main()
