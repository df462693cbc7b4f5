"""Checks ``impl="auto"`` / ``"pallas"`` against ``impl="xla"`` on the current backend.

    python -m benchmarks.routes_check [--json PATH]

For each case (35B GDN dims: Hk 16, Hv 32, K = V = 128; random trees; bf16 and f32 inputs;
N = 16, 64, 128) prints which implementation ``"auto"`` resolves to and the relative error of
``tree_verify``'s outputs ``O``, its ``U`` and of ``tree_commit``'s state against the XLA path,
for ``"auto"`` and ``"pallas"`` (a case outside the kernels' limits shows their error message;
on a GPU ``"pallas"`` runs f32 inputs at N = 128 with bf16x3 dots, the tf32x3 build exceeding
the shared memory per block). Exits non-zero on an error above 1e-3.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import markdown_table, rel, write_json
from gdn_jax import tree_commit, tree_verify
from gdn_jax.dispatch import resolve_impl

TOL = 1e-3


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
        b=b,
        n=n,
        dtype=jnp.dtype(dtype).name,
        auto_picks=resolve_impl("auto", "tree_verify", q, k, v),
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


COLUMNS = ["B", "N", "dtype", ("auto_picks", "auto picks")]
COLUMNS += [
    (f"{impl} {key}", f"{impl}: {key}")
    for impl in ("auto", "pallas")
    for key in ("o", "u", "commit")
]


def flat(r: dict) -> dict:
    """A table row: the errors of each impl as ``'{impl} {o|u|commit}'`` (or its error message)."""
    out = dict(B=r["b"], N=r["n"], dtype=r["dtype"], auto_picks=r["auto_picks"])
    for impl in ("auto", "pallas"):
        if "error" in r[impl]:
            out[f"{impl} o"] = r[impl]["error"][:60]
        for key, val in r[impl].items():
            if key != "error":
                out[f"{impl} {key}"] = val
    return out


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.routes_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
    print(f"backend {jax.default_backend()}; relative error against impl='xla'\n")
    print(markdown_table([flat(r) for r in rows], COLUMNS, digits=2))
    write_json(args.json, rows)
    bad = [
        (r["b"], r["n"], r["dtype"], impl)
        for r in rows
        for impl in ("auto", "pallas")
        if any(v > TOL for key, v in r[impl].items() if key != "error")
    ]
    if bad:
        raise SystemExit(
            f"disagrees with the XLA path by more than {TOL} at (B, N, dtype, impl) {bad}"
        )
    return rows


if __name__ == "__main__":
    main()
