"""Errors of the TPU kernels against float64, in TPU interpret mode (any host).

    python -m benchmarks.tpu_accuracy [--nodes 16,64,128] [--json PATH]

Interpret mode runs each kernel's dots as the MXU does (bf16 products, f32 sums: the kernels
split f32 operands into bf16 pieces themselves), so these are the errors a TPU would show up to
the order of the f32 sums. Cases: random trees of every kind (chain, star, random, forest,
padded) for ``N`` nodes, batch 2, decays mild / strong / mixed, grouped heads (``Hk 1, Hv 2,
K = V = 32``, and ``Hk 2, Hv 4, K = V = 128`` at 64 nodes), float32 and bfloat16 inputs, for
each solve of the verify (Newton-Schulz or blocked forward substitution, with or without
refinement: ``newton x3`` and ``blocked x3`` run every dot of the solve at bf16x3, the others
build the inverse in one-pass bf16 and refine ``U``); then the commit of every row's deepest path, the chunked prefill (packed
sequences, chunks of 64 and 128) and the decode step. Error: ``|x - x64| / |x64|`` (Frobenius)
over the real nodes; the table gives the largest over the cases.
"""

from __future__ import annotations

import argparse
import itertools

import jax.numpy as jnp
import numpy as np

from benchmarks.common import ints, write_json
from pallas_kernels import tpu

KINDS = ("chain", "star", "random", "forest", "padded")
DECAYS = ("mild", "strong", "mixed")
SOLVES = {
    "newton, refine 1 (default)": tpu.TpuVerifyBlocks(),
    "newton, refine 2": tpu.TpuVerifyBlocks(refine_steps=2),
    "newton x3": tpu.TpuVerifyBlocks(refine_steps=0),
    "blocked x3": tpu.TpuVerifyBlocks(inverse="blocked", refine_steps=0),
    "blocked, refine 1": tpu.TpuVerifyBlocks(inverse="blocked"),
}
HEADS = {32: (1, 2, 32, 32), 128: (2, 4, 128, 128)}


# --------------------------------------------------------------------------- float64 pieces


def make_tree(kind: str, n: int, rng) -> np.ndarray:
    """Parents of a random tree of ``kind`` (topological order; ``-2`` marks padding)."""
    if kind == "chain":
        return np.arange(-1, n - 1, dtype=np.int32)
    if kind == "star":
        return np.array([-1] + [0] * (n - 1), np.int32)
    real = n if kind != "padded" else int(rng.integers(n // 2, n + 1))
    par = np.full(n, -2, np.int32)
    for i in range(real):
        if i == 0 or (kind == "forest" and rng.random() < 0.25):
            par[i] = -1
        else:
            par[i] = i - 1 - min(int(rng.geometric(0.5)) - 1, i - 1)
    return par


def inputs(rng, b, n, hk, hv, dk, dv, decay):
    q = rng.normal(size=(b, n, hk, dk))
    k = rng.normal(size=(b, n, hk, dk)) / np.sqrt(dk)
    v = rng.normal(size=(b, n, hv, dv))
    if decay == "mild":
        g = -rng.uniform(0.0, 1.0, (b, n, hv))
    elif decay == "strong":
        g = -rng.uniform(0.0, 30.0, (b, n, hv))
    else:
        g = -rng.exponential(0.5, (b, n, hv))
        g[rng.random(g.shape) < 0.1] = -30.0
    beta = rng.uniform(0.05, 1.0, (b, n, hv))
    s0 = rng.normal(size=(b, hv, dk, dv))
    return q, k, v, g, beta, s0


def prep64(q, k, scale=None):
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    return q * (q.shape[-1] ** -0.5 if scale is None else scale), k


def tree64(q, k, v, g, beta, parents, s0):
    """float64 ``o, u [B, N, Hv, V]`` and per-node states, each node from its parent's state
    (l2norm on, default scale)."""
    q, k = prep64(*(np.asarray(x, np.float64) for x in (q, k)))
    v, g, beta, s0 = (np.asarray(x, np.float64) for x in (v, g, beta, s0))
    b, n, hv, dv = v.shape
    grp = hv // k.shape[2]
    qh, kh = np.repeat(q, grp, axis=2), np.repeat(k, grp, axis=2)
    o, u = np.zeros((b, n, hv, dv)), np.zeros((b, n, hv, dv))
    states = np.zeros((b, n) + s0.shape[1:])
    for r in range(b):
        for i, p in enumerate(parents[r]):
            if p == -2:
                continue
            s = np.exp(g[r, i])[:, None, None] * (s0[r] if p == -1 else states[r, p])
            u[r, i] = beta[r, i, :, None] * (v[r, i] - np.einsum("hkv,hk->hv", s, kh[r, i]))
            s = s + kh[r, i][:, :, None] * u[r, i][:, None, :]
            states[r, i] = s
            o[r, i] = np.einsum("hkv,hk->hv", s, qh[r, i])
    return o, u, states


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def sequence64(q, k, v, g, beta, s0):
    """float64 ``(o [T, Hv, V], final state)`` of one sequence."""
    o, _, states = tree64(
        q[None], k[None], v[None], g[None], beta[None], [np.arange(-1, len(q) - 1)], s0[None]
    )
    return o[0], (states[0, -1] if len(q) else s0)


# ----------------------------------------------------------------------------------- cases


def verify_rows(nodes: list[int], seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for n, kind, decay, dtype in itertools.product(
        nodes, KINDS, DECAYS, (jnp.float32, jnp.bfloat16)
    ):
        dims = [HEADS[32]] + ([HEADS[128]] if n == 64 and decay == "mixed" else [])
        for hk, hv, dk, dv in dims:
            parents = np.stack([make_tree(kind, n, rng) for _ in range(2)])
            q, k, v, g, beta, s0 = inputs(rng, 2, n, hk, hv, dk, dv, decay)
            cast = [jnp.asarray(x, dtype) for x in (q, k, v)]
            o64, u64, states64 = tree64(
                *(np.asarray(x, np.float32) for x in cast), g, beta, parents, s0
            )
            real = parents >= -1
            f32 = [jnp.asarray(x, jnp.float32) for x in (g, beta, s0)]
            for name, blocks in SOLVES.items():
                o, u, gp = tpu.tree_verify(
                    *cast, *f32[:2], jnp.asarray(parents), f32[2],
                    use_qk_l2norm=True, blocks=blocks, interpret=True,
                )  # fmt: skip
                row = dict(
                    kernel="verify", solve=name, dtype=jnp.dtype(dtype).name, n=n, kind=kind,
                    decay=decay, dk=dk, o=rel(np.asarray(o)[real], o64[real]),
                    u=rel(np.asarray(u)[real], u64[real]),
                )  # fmt: skip
                if blocks == tpu.TpuVerifyBlocks():
                    row["commit"] = _commit_error(cast[1], u, gp, parents, s0, states64)
                out.append(row)
    return out


def _commit_error(k, u, gp, parents, s0, states64) -> float:
    """Commit of each row's deepest path against the float64 state at its end."""
    paths = []
    for par in parents:
        depth = np.zeros(len(par), int)
        for i, p in enumerate(par):
            depth[i] = -1 if p == -2 else (depth[p] + 1 if p >= 0 else 0)
        node, path = int(np.argmax(depth)), []
        while node >= 0:
            path.append(node)
            node = int(par[node])
        paths.append(path[::-1])
    d = max(len(p) for p in paths)
    path = np.array([p + [0] * (d - len(p)) for p in paths], np.int32)
    plen = np.array([len(p) for p in paths], np.int32)
    got = tpu.tree_commit(
        jnp.asarray(s0, jnp.float32), k, u, gp, jnp.asarray(path), jnp.asarray(plen),
        use_qk_l2norm=True, interpret=True,
    )  # fmt: skip
    want = np.stack([states64[r, path[r, plen[r] - 1]] for r in range(len(paths))])
    return rel(got, want)


def chunk_rows(seed: int) -> list[dict]:
    """Packed sequences (one empty) through the chunked prefill, against float64."""
    rng = np.random.default_rng(seed)
    out = []
    for c, dtype in itertools.product((64, 128), (jnp.float32, jnp.bfloat16)):
        cu = np.array([0, 5, 5, 200, 330], np.int32)
        t = int(cu[-1])
        q, k, v, g, beta, _ = inputs(rng, 1, t, 1, 2, 32, 32, "mixed")
        h0 = rng.normal(size=(len(cu) - 1, 2, 32, 32))
        cast = [jnp.asarray(x, dtype) for x in (q, k, v)]
        o, fin = tpu.chunk_gated_delta_rule(
            *cast, jnp.asarray(g, jnp.float32), jnp.asarray(beta, jnp.float32),
            jnp.asarray(h0, jnp.float32), use_qk_l2norm=True, chunk_size=c,
            cu_seqlens=jnp.asarray(cu), interpret=True,
        )  # fmt: skip
        qf, kf, vf = (np.asarray(x, np.float32)[0] for x in cast)
        o_err, s_err = 0.0, 0.0
        for i in range(len(cu) - 1):
            a, e = cu[i], cu[i + 1]
            o64, s64 = sequence64(qf[a:e], kf[a:e], vf[a:e], g[0, a:e], beta[0, a:e], h0[i])
            if e > a:
                o_err = max(o_err, rel(np.asarray(o)[0, a:e], o64))
            s_err = max(s_err, rel(fin[i], s64))
        out.append(dict(kernel="chunk", chunk=c, dtype=jnp.dtype(dtype).name, o=o_err, state=s_err))
    return out


def decode_rows(seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for t, dtype in itertools.product((1, 8), (jnp.float32, jnp.bfloat16)):
        q, k, v, g, beta, s0 = inputs(rng, 2, t, 1, 2, 32, 32, "mixed")
        cast = [jnp.asarray(x, dtype) for x in (q, k, v)]
        o, s = tpu.recurrent(
            *cast, *(jnp.asarray(x, jnp.float32) for x in (g, beta, s0)),
            use_qk_l2norm=True, interpret=True,
        )  # fmt: skip
        f = [np.asarray(x, np.float32) for x in cast]
        ref = [sequence64(f[0][r], f[1][r], f[2][r], g[r], beta[r], s0[r]) for r in range(2)]
        out.append(
            dict(
                kernel="decode",
                tokens=t,
                dtype=jnp.dtype(dtype).name,
                o=rel(o, np.stack([x[0] for x in ref])),
                state=rel(s, np.stack([x[1] for x in ref])),
            )  # fmt: skip
        )
    return out


def summary(rows: list[dict]) -> list[dict]:
    """Largest errors per (kernel, variant, dtype)."""
    groups: dict[tuple, dict] = {}
    for r in rows:
        key = (r["kernel"], r.get("solve", r.get("chunk", r.get("tokens"))), r["dtype"])
        g = groups.setdefault(key, dict(kernel=key[0], variant=key[1], dtype=key[2], cases=0))
        g["cases"] += 1
        for col in ("o", "u", "state", "commit"):
            if col in r:
                g[col] = max(g.get(col, 0.0), r[col])
    return list(groups.values())


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--nodes", type=ints, default=[16, 64, 128])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = verify_rows(args.nodes, args.seed) + chunk_rows(args.seed) + decode_rows(args.seed)
    table = summary(rows)
    print("| kernel | variant | dtype | cases | O | U | state | commit |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for g in table:
        cells = [f"{g[c]:.1e}" if c in g else "-" for c in ("o", "u", "state", "commit")]
        print(
            f"| {g['kernel']} | {g['variant']} | {g['dtype']} | {g['cases']} | "
            + " | ".join(cells)
            + " |"
        )
    if args.json:
        write_json(args.json, dict(summary=table, rows=rows))
    return rows


if __name__ == "__main__":
    main()
