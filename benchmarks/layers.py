"""One decoder layer of each kind (GDN + MoE, gated attention + MoE) at Qwen3.5-35B-A3B dims.

For each layer kind, through the model step functions (a one-layer model with a small vocab, so
the embedding and LM head are negligible): prefill tokens/s (``--prefill-len`` tokens, one
row), tree verify time for ``N`` in ``--tree-sizes`` (random trees after ``--context``
committed tokens), and the decode step time (``--batch`` rows at ``--context``). Median of
``--reps`` timed calls after a warm-up, fresh random tokens per call. Prints a table and writes
JSON (``--json``).

    python -m benchmarks.layers --json layers.json          # GPU, Qwen3.5-35B dims
    python -m benchmarks.layers --smoke                      # tiny dims, CPU, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.common import CONFIG_DIR, ints, markdown_table, write_json  # noqa: E402
from gdn_jax.models import ModelConfig, init_random  # noqa: E402
from gdn_jax.models.cache import init_cache  # noqa: E402
from gdn_jax.models.config import FULL, LINEAR  # noqa: E402
from gdn_jax.models.steps import decode, prefill, verify_tree  # noqa: E402

CONFIG = CONFIG_DIR / "qwen3_5_35b_a3b.json"
SMOKE = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
)


def median_time(fn, make_args, reps: int) -> float:
    """Median seconds of ``fn(*make_args(i))`` over ``reps`` calls, after one warm-up."""
    jax.block_until_ready(fn(*make_args(-1)))
    ts = []
    for i in range(reps):
        args = make_args(i)
        jax.block_until_ready(args)
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def random_parents(rng: np.random.Generator, n: int) -> np.ndarray:
    """A random topologically ordered tree: node ``i``'s parent is uniform in ``[-1, i)``,
    skewed towards recent nodes so that depths resemble real draft trees."""
    return np.array([-1] + [int(rng.integers(max(-1, i - 4), i)) for i in range(1, n)], np.int32)


def bench_kind(cfg: ModelConfig, kind: str, args, rng: np.random.Generator) -> dict:
    one = dataclasses.replace(
        cfg,
        num_hidden_layers=1,
        layer_types=(kind,),
        vocab_size=args.vocab,
        mtp_num_hidden_layers=0,
    )
    dtype = jnp.bfloat16
    model = init_random(one, dtype, seed=0)
    page = args.page_size
    max_len = max(args.prefill_len, args.context + max(args.tree_sizes)) + page
    tok = lambda *shape: jnp.asarray(rng.integers(0, args.vocab, shape), jnp.int32)
    prefill_j = nnx.jit(prefill)
    decode_j = nnx.jit(decode)
    verify_j = nnx.jit(verify_tree)
    out = {"layer": kind}

    empty1 = init_cache(one, 1, max_len=max_len, page_size=page, dtype=dtype)
    t = median_time(
        lambda ids: prefill_j(model, ids, empty1), lambda i: (tok(1, args.prefill_len),), args.reps
    )
    out["prefill_tokens_per_s"] = args.prefill_len / t
    out["prefill_ms"] = t * 1e3

    _, ctx1 = prefill_j(model, tok(1, args.context), empty1)
    for n in args.tree_sizes:
        t = median_time(
            lambda ids, par: verify_j(model, ids, par, ctx1),
            lambda i, n=n: (tok(1, n), jnp.asarray(random_parents(rng, n))[None]),
            args.reps,
        )
        out[f"verify_N{n}_ms"] = t * 1e3

    emptyb = init_cache(one, args.batch, max_len=max_len, page_size=page, dtype=dtype)
    _, ctxb = prefill_j(model, tok(args.batch, args.context), emptyb)
    t = median_time(lambda ids: decode_j(model, ids, ctxb), lambda i: (tok(args.batch),), args.reps)
    out["decode_step_ms"] = t * 1e3
    return out


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.layers",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", default=str(CONFIG), help="HF-style config.json of the model")
    p.add_argument("--smoke", action="store_true", help="tiny dims and sizes (CPU check)")
    p.add_argument("--prefill-len", type=int, default=4096)
    p.add_argument(
        "--context", type=int, default=4096, help="committed tokens before verify/decode"
    )
    p.add_argument("--tree-sizes", type=ints, default=[8, 32, 64])
    p.add_argument("--batch", type=int, default=1, help="rows in the decode step")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--vocab", type=int, default=1024, help="vocab of the one-layer model")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    args = p.parse_args(argv)

    cfg = ModelConfig.from_json(args.config)
    if args.smoke:
        cfg = dataclasses.replace(cfg, **SMOKE)
        args.prefill_len, args.context, args.page_size = 64, 32, 16
        args.vocab, args.reps = 128, 2
    rng = np.random.default_rng(0)
    rows = [bench_kind(cfg, kind, args, rng) for kind in (LINEAR, FULL)]

    cols = ["layer", ("prefill_tokens_per_s", f"prefill ({args.prefill_len} tokens) tokens/s")]
    cols += [(f"verify_N{n}_ms", f"verify N = {n} ms") for n in args.tree_sizes]
    cols.append(("decode_step_ms", f"decode step (B {args.batch}) ms"))
    print(
        f"device: {jax.devices()[0].device_kind}; hidden {cfg.hidden_size}, "
        f"prefill {args.prefill_len}, context {args.context}, batch {args.batch}, bf16\n"
    )
    print(markdown_table(rows, cols, digits=4))
    result = {
        "device": jax.devices()[0].device_kind,
        "config": args.config,
        "args": vars(args),
        "rows": rows,
    }
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    return rows


if __name__ == "__main__":
    main()
