"""Decode timing of the arena paged attention kernel: one key split vs the automatic count.

Qwen3.5-35B-A3B attention dims (Hq 16, Hkv 2, D 256, bf16 cache and queries), one query per
row at the last position, every row at the full context. The arena is built as
``tests/pallas_kernels/test_attention.py`` builds it: a uint32 arena of random words (NaN
patterns included), KV units ``[La, 2, S, Hkv, D]`` at shuffled (segment, word) places,
``kv_offset`` words into each unit, handles in a ``[B, MP]`` page table (``-1`` past the
context when the table is wider: ``--max-len``).

Per shape: the automatic count's output against a float64 numpy reference (max abs error) and
against ``num_splits=1`` (max abs difference); then the time per call. Timing: a jitted chain
of ``n`` dependent calls (each call's output is the next call's query, so nothing is hoisted
or merged), ``block_until_ready``, median of ``--reps`` runs after warm-up, for chains of
``n`` and ``2n`` calls: us per call = ``(median(2n) - median(n)) / n`` (the dispatch and sync
cost of one jitted call cancels). ``--sweep`` adds, per shape, the time at each
``pages_per_step`` and ``num_splits``.

    python -m benchmarks.attention_splits                 # GPU: B 1, 16, 64 x context 512, 4096
    python -m benchmarks.attention_splits --max-len 32768 # a table as wide as a 32k engine's
    python -m benchmarks.attention_splits --sweep --batch 1 --context 512
    python -m benchmarks.attention_splits --smoke         # CPU (interpret mode), seconds

Each shape's line (accuracy first, then times) is printed as it finishes; ``--json`` writes
the rows.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import markdown_table, write_json
from pallas_kernels.attention.arena import paged_attention

HQ, HKV, D = 16, 2, 256
LAYERS, LAYER, KV_OFFSET = 2, 1, 64
SCALE = D**-0.5


def build(b, ctx, max_len, page_size, seed=0):
    """Arena pieces, bf16 K/V per row ``[B, ctx, Hkv, D]`` (numpy) and the queries."""
    rng = np.random.default_rng(seed)
    s = page_size
    mp = -(-max(max_len, ctx) // s)
    live = -(-ctx // s)  # pages per row
    units = b * live
    token_words = HKV * D // 2
    unit_words = LAYERS * 2 * s * token_words
    stride = KV_OFFSET + unit_words + 32
    segs = min(8, units)
    per_seg = -(-units // segs)
    arena = rng.integers(0, 2**32, (segs, per_seg * stride), dtype=np.uint32)
    arena[:, ::7] = 0x7FC00000  # NaN patterns, as the tests' recycled words
    slots = rng.permutation(segs * per_seg)[:units]
    table = np.stack([slots % segs, (slots // segs) * stride], 1).astype(np.int32)
    handles = np.full((b, mp), -1, np.int32)
    bf16 = jnp.bfloat16
    k = np.zeros((b, live * s, HKV, D), bf16)
    v = np.zeros_like(k)
    for r in range(b):
        vals = rng.standard_normal((live, LAYERS, 2, s, HKV, D), np.float32).astype(bf16)
        k[r] = vals[:, LAYER, 0].reshape(live * s, HKV, D)
        v[r] = vals[:, LAYER, 1].reshape(live * s, HKV, D)
        words = vals.reshape(live, -1).view(np.uint32)
        for j in range(live):
            h = r * live + j
            handles[r, j] = h
            seg, word = table[h]
            arena[seg, word + KV_OFFSET : word + KV_OFFSET + unit_words] = words[j]
    q = rng.standard_normal((b, 1, HQ, D), np.float32).astype(bf16)
    kv_len = np.full((b,), ctx, np.int32)
    q_pos = (kv_len - 1)[:, None]
    dev = (arena, table, handles, kv_len, q_pos)
    return tuple(jnp.asarray(x) for x in dev), (k[:, :ctx], v[:, :ctx]), q


def reference(q, k, v):
    """float64 decode attention: ``q [B, 1, Hq, D]``, ``k, v [B, ctx, Hkv, D]``."""
    q = np.asarray(q, np.float64)[:, 0].reshape(q.shape[0], HKV, HQ // HKV, D)
    out = np.empty(q.shape)
    for r in range(q.shape[0]):
        kr, vr = np.asarray(k[r], np.float64), np.asarray(v[r], np.float64)
        sc = np.einsum("hgd,thd->hgt", q[r], kr) * SCALE
        p = np.exp(sc - sc.max(-1, keepdims=True))
        out[r] = np.einsum("hgt,thd->hgd", p, vr) / p.sum(-1, keepdims=True)
    return out.reshape(q.shape[0], 1, HQ, D)


def attention(parts, page_size, interpret, **knobs):
    arena, table, handles, kv_len, q_pos = parts
    kw = dict(layer=LAYER, kv_offset=KV_OFFSET, page_size=page_size, kv_heads=HKV)
    kw.update(kv_dtype=jnp.bfloat16, scale=SCALE, interpret=interpret, **knobs)
    return lambda q: paged_attention(q, arena, table, handles, kv_len, q_pos, **kw)


def grid(fn, q):
    """The kernel's grid (a 4th entry: key splits)."""
    eqns = jax.make_jaxpr(fn)(q).jaxpr.eqns
    [eqn] = [e for e in eqns if e.primitive.name == "pallas_call"]
    return tuple(eqn.params["grid_mapping"].grid)


def per_call_us(fn, q, reps, inner):
    def chain(n):
        def run(x):
            for _ in range(n):
                x = fn(x)
            return x

        return jax.jit(run)

    meds = []
    for n in (inner, 2 * inner):
        f = chain(n)
        for _ in range(3):
            f(q).block_until_ready()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            f(q).block_until_ready()
            ts.append(time.perf_counter() - t0)
        meds.append(statistics.median(ts))
    per = (meds[1] - meds[0]) / inner
    if per <= 0:  # noise larger than the calls: the longer chain's mean instead
        per = meds[1] / (2 * inner)
    return per * 1e6


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.attention_splits",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--smoke", action="store_true", help="small shapes, few reps (CPU)")
    ap.add_argument("--batch", type=int, nargs="+", default=None)
    ap.add_argument("--context", type=int, nargs="+", default=None)
    ap.add_argument("--max-len", type=int, default=0, help="page table width in tokens")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--inner", type=int, default=None, help="calls per timed chain")
    ap.add_argument("--sweep", action="store_true", help="also each pages_per_step, num_splits")
    ap.add_argument("--json", metavar="PATH", help="also write the rows here")
    a = ap.parse_args(argv)
    interpret = jax.default_backend() != "gpu"
    batches = a.batch or ([1, 2] if a.smoke else [1, 16, 64])
    contexts = a.context or ([256, 384] if a.smoke else [512, 4096])
    reps = a.reps or (3 if a.smoke else 50)
    inner = a.inner or (1 if a.smoke else 16)
    print(
        f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}"
    )
    print(f"Hq {HQ}, Hkv {HKV}, D {D}, bf16, S {a.page_size}, one query per row")
    print(f"us per call: chains of {inner} and {2 * inner} calls, median of {reps}\n")
    rows, sweeps = [], []
    for ctx in contexts:
        for b in batches:
            parts, (k, v), q_np = build(b, ctx, a.max_len or ctx, a.page_size)
            q = jnp.asarray(q_np)
            one = attention(parts, a.page_size, interpret, num_splits=1)
            auto = attention(parts, a.page_size, interpret)
            g = grid(auto, q)
            splits = g[3] if len(g) == 4 else 1
            ref = reference(q_np.astype(np.float32), k, v)
            y1, ya = (np.asarray(f(q).astype(jnp.float32)) for f in (one, auto))
            err = float(np.abs(ya - ref).max())
            err1 = float(np.abs(y1 - ref).max())
            diff = float(np.abs(ya - y1).max())
            print(
                f"  B {b}, context {ctx}: {splits} splits, max err {err:.2e} (one split "
                f"{err1:.2e}, difference {diff:.2e})",
                flush=True,
            )
            t1 = per_call_us(one, q, reps, inner)
            ta = t1 if splits == 1 else per_call_us(auto, q, reps, inner)
            rows.append(
                dict(
                    batch=b,
                    context=ctx,
                    splits=splits,
                    us_one=t1,
                    us_auto=ta,
                    speedup=t1 / ta,
                    err_auto=err,
                    err_one=err1,
                    diff=diff,
                )
            )
            print(f"  B {b}, context {ctx}: {t1:.1f} us at one split, {ta:.1f} us auto", flush=True)
            if a.sweep:
                mp = parts[2].shape[1]
                for pps in (1, 2, 4, 8):
                    if pps * a.page_size > 256:
                        continue
                    steps = -(-mp // pps)
                    for ns in (1, 2, 4, 8, 16, 32, 64):
                        if ns > steps:
                            break
                        f = attention(
                            parts, a.page_size, interpret, pages_per_step=pps, num_splits=ns
                        )
                        us = per_call_us(f, q, reps, inner)
                        e = float(np.abs(np.asarray(f(q).astype(jnp.float32)) - ref).max())
                        sweeps.append((b, ctx, pps, ns, us, e))
    cols = [
        ("batch", "batch"),
        ("context", "context"),
        ("splits", "splits"),
        ("us_one", "us, one split"),
        ("us_auto", "us, auto"),
        ("speedup", "speedup"),
        ("err_auto", "max err auto"),
        ("err_one", "max err one split"),
        ("diff", "max diff auto vs one"),
    ]
    print()
    print(markdown_table(rows, cols, digits=3))
    if sweeps:
        print("\n| batch | context | pages_per_step | num_splits | us | max err |")
        print("|---:|---:|---:|---:|---:|---:|")
        for b, ctx, pps, ns, us, e in sweeps:
            print(f"| {b} | {ctx} | {pps} | {ns} | {us:.1f} | {e:.2e} |")
    write_json(
        a.json,
        dict(
            benchmark="attention_splits",
            device=jax.devices()[0].device_kind,
            args=vars(a),
            rows=rows,
            sweeps=sweeps,
        ),
    )
    return rows


if __name__ == "__main__":
    main()
