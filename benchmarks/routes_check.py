"""Checks ``impl="auto"`` / ``"pallas"`` against ``impl="xla"`` on the current backend.

    python -m benchmarks.routes_check [--json PATH]

For each case (35B GDN dims, random trees, bf16 and f32 inputs, N = 16, 64, 128) prints which
implementation ``"auto"`` resolves to and the relative error of ``tree_verify`` outputs, ``U``
and of ``tree_commit`` against the XLA path. Exits non-zero on an error above 1e-3.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from gdn_jax import tree_commit, tree_verify
from gdn_jax.dispatch import resolve_impl


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def case(b: int, n: int, dtype, rng) -> dict:
    hk, hv, d = 16, 32, 128
    q = jnp.asarray(rng.normal(size=(b, n, hk, d)), dtype)
    k = jnp.asarray(rng.normal(size=(b, n, hk, d)), dtype)
    v = jnp.asarray(rng.normal(size=(b, n, hv, d)), dtype)
    g = jnp.asarray(-rng.exponential(0.5, size=(b, n, hv)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.1, 1, size=(b, n, hv)), jnp.float32)
    s0 = jnp.asarray(rng.normal(0, 0.1, size=(b, hv, d, d)), jnp.float32)
    parents = np.array(
        [[-1] + [int(rng.integers(max(0, i - 6), i)) for i in range(1, n)] for _ in range(b)],
        np.int32,
    )
    path = np.full((b, n), -1, np.int32)
    plen = np.zeros(b, np.int32)
    for r in range(b):
        node, chain = n - 1, []
        while node >= 0:
            chain.append(node)
            node = parents[r, node]
        path[r, : len(chain)] = chain[::-1]
        plen[r] = len(chain)
    out = dict(
        b=b, n=n, dtype=jnp.dtype(dtype).name, auto_picks=resolve_impl("auto", "tree_verify", q, k, v)
    )
    ref_o, ref_c = tree_verify(q, k, v, g, beta, parents, s0, use_qk_l2norm=True, impl="xla")
    ref_s = tree_commit(s0, ref_c, path, plen, impl="xla")
    for impl in ("auto", "pallas"):
        try:
            o, c = jax.jit(lambda *a, impl=impl: tree_verify(*a, use_qk_l2norm=True, impl=impl))(
                q, k, v, g, beta, parents, s0
            )
            s = tree_commit(s0, c, path, plen, impl=impl)
            out[impl] = dict(o=rel(o, ref_o), u=rel(c.u, ref_c.u), commit=rel(s, ref_s))
        except ValueError as e:  # the kernel's stated limits
            out[impl] = dict(error=str(e)[:120])
    return out


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--nodes", default="16,64,128", help="tree sizes to check (default 16,64,128)")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    batch = {16: 2, 64: 4, 128: 2}
    rows = [
        case(batch.get(n, 2), n, dt, rng)
        for n in (int(x) for x in args.nodes.split(","))
        for dt in (jnp.bfloat16, jnp.float32)
    ]
    bad = False
    print(f"backend {jax.default_backend()}")
    for r in rows:
        print(json.dumps(r))
        for impl in ("auto", "pallas"):
            errs = [v for key, v in r[impl].items() if key != "error"]
            bad |= any(e > 1e-3 for e in errs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if bad:
        raise SystemExit("an implementation disagrees with the XLA path by more than 1e-3")
    return rows


if __name__ == "__main__":
    main()
