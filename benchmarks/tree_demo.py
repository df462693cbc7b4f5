"""CPU demo: verify one random draft tree through one GDN layer, by tree WY and by snapshots.

    python -m benchmarks.tree_demo [--nodes 64] [--batch 2] [--config qwen3_5_35b_a3b] [--json PATH]

One GDN layer at the config's dims with random weights: hidden states -> in-projections ->
tree causal conv (SiLU) -> q, k, v; ``beta = sigmoid(b)``, ``g = -exp(A_log) softplus(a + dt_bias)``
-> the gated delta rule over a random draft tree, (a) by ``tree_verify`` (one triangular solve,
keeps ``U``) and (b) by snapshot verification (a full ``K x V`` state per node, the vLLM/SGLang
method). Checks the two agree, commits a random accepted path both ways, checks the states agree,
and prints time (median of jitted runs) and speculative memory of both.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import fmt_bytes, gdn_dims, write_json
from gdn_jax import (
    DraftTree,
    snapshot_tree_commit,
    snapshot_tree_verify,
    tree_causal_conv1d,
    tree_commit,
    tree_conv_commit,
    tree_verify,
)


def random_tree(n: int, vocab: int, rng: np.random.Generator) -> DraftTree:
    """A trie of random candidate continuations with exactly ``n`` nodes (after padding)."""
    paths: list[list[int]] = []
    while True:
        depth = int(rng.integers(2, 9))
        base = paths[int(rng.integers(len(paths)))] if paths and rng.random() < 0.7 else []
        cut = int(rng.integers(0, len(base) + 1))
        cand = base[:cut] + [int(t) for t in rng.integers(0, vocab, depth)]
        tree = DraftTree.from_paths(paths + [cand])
        if tree.num_nodes > n:
            return (
                DraftTree.from_paths(paths).pad(n) if paths else DraftTree.from_parents([-1]).pad(n)
            )
        paths.append(cand)


def layer_params(d, rng, dtype=jnp.bfloat16):
    s = d.hidden**-0.5
    return dict(
        w_qkv=jnp.asarray(rng.normal(0, s, (d.hidden, d.conv_dim)), dtype),
        w_ab=jnp.asarray(rng.normal(0, s, (d.hidden, 2 * d.hv)), dtype),
        conv=jnp.asarray(rng.normal(0, 0.5, (d.conv_dim, d.conv_width)), jnp.float32),
        a_log=jnp.asarray(np.log(rng.uniform(1, 16, d.hv)), jnp.float32),
        dt_bias=jnp.asarray(rng.normal(0, 1, d.hv), jnp.float32),
    )


def project(params, x, parents, conv_state, d):
    """Hidden states of the draft nodes -> (q, k, v, g, beta, conv input) for the GDN rule."""
    mixed = jnp.einsum("bnd,dc->bnc", x, params["w_qkv"])
    conv = tree_causal_conv1d(mixed, parents, conv_state, params["conv"])
    b, n = x.shape[:2]
    q = conv[..., : d.hk * d.k].reshape(b, n, d.hk, d.k)
    k = conv[..., d.hk * d.k : 2 * d.hk * d.k].reshape(b, n, d.hk, d.k)
    v = conv[..., 2 * d.hk * d.k :].reshape(b, n, d.hv, d.v)
    ab = jnp.einsum("bnd,dh->bnh", x, params["w_ab"]).astype(jnp.float32)
    beta = jax.nn.sigmoid(ab[..., : d.hv])
    g = -jnp.exp(params["a_log"]) * jax.nn.softplus(ab[..., d.hv :] + params["dt_bias"])
    return q, k, v, g, beta, mixed


def timeit(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.tree_demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--config",
        default="qwen3_5_35b_a3b",
        help="config name in benchmarks/configs or a JSON path",
    )
    ap.add_argument("--nodes", type=int, default=64, help="draft tree size N (default 64)")
    ap.add_argument("--batch", type=int, default=2, help="sequences verified together (default 2)")
    ap.add_argument(
        "--repeats", type=int, default=5, help="timed runs per method (median reported)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args(argv)
    if args.nodes < 1 or args.batch < 1 or args.repeats < 1:
        ap.error("--nodes, --batch and --repeats must be positive")
    d = gdn_dims(args.config)
    rng = np.random.default_rng(args.seed)
    trees = [random_tree(args.nodes, 1000, rng) for _ in range(args.batch)]
    parents = jnp.asarray(np.stack([t.parents for t in trees]))
    params = layer_params(d, rng)
    b, n = args.batch, args.nodes
    x = jnp.asarray(rng.normal(size=(b, n, d.hidden)), jnp.bfloat16)
    conv_state = jnp.asarray(rng.normal(size=(b, d.conv_width - 1, d.conv_dim)), jnp.bfloat16)
    s0 = jnp.asarray(rng.normal(0, 0.1, size=(b, d.hv, d.k, d.v)), jnp.float32)
    print(
        f"{d.name}: one GDN layer (Hk={d.hk}, Hv={d.hv}, K={d.k}, V={d.v}, conv {d.conv_dim}x{d.conv_width}), "
        f"B={b}, N={n} draft nodes, max depth {max(int(t.depth.max()) for t in trees) + 1}, "
        f"backend {jax.default_backend()}"
    )

    # The in-projections and the tree conv are shared by both methods: run them once.
    proj = jax.jit(lambda x, parents, conv_state: project(params, x, parents, conv_state, d))
    q, k, v, g, beta, mixed = proj(x, parents, conv_state)

    @jax.jit
    def verify_wy(q, k, v, g, beta, parents, s0):
        return tree_verify(q, k, v, g, beta, parents, s0, use_qk_l2norm=True)

    @jax.jit
    def verify_snapshot(q, k, v, g, beta, parents, s0):
        o, states = snapshot_tree_verify(q, k, v, g, beta, parents, s0, use_qk_l2norm=True)
        # the snapshot method also keeps a conv state (the last W-1 inputs) per node
        conv_snap = jnp.broadcast_to(mixed[:, :, None], (b, n, d.conv_width - 1, d.conv_dim))
        return o, (states, conv_snap)

    gdn_in = (q, k, v, g, beta, parents, s0)
    o_wy, cache = verify_wy(*gdn_in)
    o_sn, (states, conv_snap) = verify_snapshot(*gdn_in)
    o_wy32, o_sn32 = np.asarray(o_wy, np.float32), np.asarray(o_sn, np.float32)
    real = np.asarray(parents) >= -1
    err = float(np.abs(o_wy32 - o_sn32)[real].max() / np.abs(o_sn32[real]).max())

    # accept a random root-to-leaf prefix per sequence
    depth = max(int(t.depth.max()) + 1 for t in trees)
    paths, lens = [], []
    for t in trees:
        leaf = int(rng.choice(t.leaves()))
        p, m = t.path_array(leaf, depth)
        paths.append(p)
        lens.append(int(rng.integers(0, m + 1)))
    path, plen = jnp.asarray(np.stack(paths)), jnp.asarray(np.array(lens, np.int32))
    commit_wy = jax.jit(
        lambda s0, cache, mixed: (
            tree_commit(s0, cache, path, plen),
            tree_conv_commit(mixed, conv_state, path, plen),
        )
    )
    last = jnp.maximum(plen - 1, 0)
    commit_sn = jax.jit(
        lambda s0, states, conv_snap: (
            snapshot_tree_commit(s0, states, path, plen),
            conv_snap[jnp.arange(b), path[jnp.arange(b), last]],
        )
    )
    s_wy, _ = commit_wy(s0, cache, mixed)
    s_sn, _ = commit_sn(s0, states, conv_snap)
    state_err = float(
        np.abs(np.asarray(s_wy) - np.asarray(s_sn)).max() / np.abs(np.asarray(s_sn)).max()
    )

    t_proj = timeit(proj, x, parents, conv_state, repeats=args.repeats)
    t_wy = timeit(verify_wy, *gdn_in, repeats=args.repeats)
    t_sn = timeit(verify_snapshot, *gdn_in, repeats=args.repeats)
    tc_wy = timeit(commit_wy, s0, cache, mixed, repeats=args.repeats)
    tc_sn = timeit(commit_sn, s0, states, conv_snap, repeats=args.repeats)
    mem_wy, mem_sn = nbytes((cache, mixed)), nbytes((states, conv_snap))

    print(
        f"outputs agree: max |O_wy - O_snapshot| / max |O| = {err:.2e}; "
        f"committed states (accepted lengths {lens}) agree: {state_err:.2e}"
    )
    hdr = f"{'method':<22}{'verify ms':>11}{'commit ms':>11}{'spec. memory':>15}{'x model (' + str(d.num_gdn_layers) + ' GDN layers)':>26}"
    print(hdr)
    print("-" * len(hdr))
    for name, tv, tc, mem in (
        ("tree WY", t_wy, tc_wy, mem_wy),
        ("snapshot per node", t_sn, tc_sn, mem_sn),
    ):
        print(
            f"{name:<22}{tv * 1e3:>11.2f}{tc * 1e3:>11.3f}{fmt_bytes(mem):>15}{fmt_bytes(mem * d.num_gdn_layers):>26}"
        )
    print(
        f"shared by both: in-projections + tree conv {t_proj * 1e3:.2f} ms (not in the verify column)"
    )
    print(
        f"tree WY vs snapshot: {t_sn / t_wy:.1f}x faster verify, {mem_sn / mem_wy:.1f}x less speculative memory "
        "(CPU timings: ratios only; GPU figures are in benchmarks/README.md)"
    )
    result = dict(
        config=d.name,
        batch=b,
        nodes=n,
        backend=jax.default_backend(),
        max_rel_err=err,
        state_rel_err=state_err,
        accepted=lens,
        shared_projection_s=t_proj,
        verify_s=dict(wy=t_wy, snapshot=t_sn),
        commit_s=dict(wy=tc_wy, snapshot=tc_sn),
        spec_bytes=dict(wy=mem_wy, snapshot=mem_sn),
    )
    if err > 1e-2 or state_err > 1e-4:
        raise SystemExit(f"tree WY and snapshot verification disagree: {err:.2e} / {state_err:.2e}")
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
