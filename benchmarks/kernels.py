"""Benchmark of the Pallas GDN kernels on one GPU (issue 3; DESIGN.md section 7).

Prints tables and writes JSON: tree_verify (Pallas, XLA, fused Pallas snapshot verify, floor),
tree_commit (Pallas, XLA, floor), speculative memory per node (WY vs snapshot), and chunked
prefill (Pallas vs flash-linear-attention's Triton ``chunk_gated_delta_rule`` when importable).
The floor of each op is ``max(bytes / HBM bandwidth, flops / bf16 matmul rate)``, both measured
at the start of the same run. Timings: median over ``--reps`` timed calls of one jitted program
that runs the op on ``R`` distinct input sets back to back (rotating inputs past the L2 and
amortising the host dispatch), divided by ``R``. Verify and commit run the ``R`` sets inside one
jitted program (:func:`timed_fused`: one dispatch, kernels back to back, as the layers of a model
step), so small launches are timed on the device, not on the host's dispatch rate.
``--verify-split`` also times the two-kernel verify (:func:`pallas_kernels.tree_verify_split`)
next to the fused one (columns ``pallas_split_us``, ``split_over_fused``).

    python benchmarks/kernels.py --json results.json
"""

# The closures handed to attempt()/timed() run inside the loop iteration that makes them.
# ruff: noqa: B023
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

import pallas_kernels as pk  # noqa: E402
from gdn_jax.chunk import chunk_gated_delta_rule as xla_chunk  # noqa: E402
from gdn_jax.tree_wy import tree_commit as xla_commit  # noqa: E402
from gdn_jax.tree_wy import tree_verify as xla_verify  # noqa: E402
from pallas_kernels.tree_verify import STAGES as VERIFY_STAGES  # noqa: E402

K = V = 128
HK = 16
BF16, F32 = jnp.bfloat16, jnp.float32


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def timed(fn, sets, reps: int, iters: int = 30) -> float:
    """Seconds per call of ``jax.jit(fn)``: back-to-back async calls rotating over the input
    sets (past the L2), blocking once at the end; median over ``reps``."""
    f = jax.jit(fn)
    for s in sets:
        jax.block_until_ready(f(*s))
    iters = max(iters, len(sets))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = None
        for i in range(iters):
            out = f(*sets[i % len(sets)])
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) / iters)
    return statistics.median(ts)


def timed_fused(fn, sets, reps: int, donate: bool = False) -> float:
    """Seconds per op when one jitted program runs ``fn`` on every input set back to back (like
    the layers of one model step: one host dispatch, device launches back to back). With four
    or more sets this is the marginal cost ``(t(R) - t(1)) / (R - 1)`` of the R-set and the
    one-set programs (medians over ``reps``): the program's fixed cost (dispatch, argument
    handling, ~100-400 us on the H200) is paid once per model step, not per layer; with fewer
    sets it is ``t(R) / R``. With ``donate`` the sets are single arrays updated in place (``fn``
    returns the new array)."""

    def program(xs):
        run = lambda xs: [fn(*x) if isinstance(x, tuple) else fn(x) for x in xs]
        f = jax.jit(run, donate_argnums=0 if donate else ())
        state = list(xs)
        out = f(state)
        jax.block_until_ready(out)
        if donate:
            state = out
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            out = f(state)
            jax.block_until_ready(out)
            ts.append(time.perf_counter() - t0)
            if donate:
                state = out
        return statistics.median(ts), (state if donate else xs)

    r = len(sets)
    t_r, sets = program(sets)
    if r < 4:
        return t_r / r
    t_1, _ = program(sets[:1])
    return max(t_r - t_1, 0.0) / (r - 1)


def attempt(row: dict, key: str, thunk) -> None:
    """``row[key] = thunk()``; a failure is recorded in the row instead of ending the run."""
    t0 = time.perf_counter()
    try:
        row[key] = thunk()
        log(f"{row.get('op')} {key} = {row[key]:.4g} ({time.perf_counter() - t0:.1f} s)")
    except Exception as e:  # keep the other measurements of the run
        row[key + "_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(f"# {row.get('op')} {key} failed: {row[key + '_error']}", file=sys.stderr)


def log(msg: str) -> None:
    print(f"# [{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def n_sets(bytes_per_call: int, cap: int = 16) -> int:
    return int(min(cap, max(1, (2 << 30) // max(bytes_per_call, 1))))


def measure_bandwidth(reps: int, size: int = 256 << 20) -> float:
    x = jax.random.normal(jax.random.key(0), (size,), F32)  # 1 GiB
    f = jax.jit(lambda a: a * 1.0001 + 0.5)
    t = timed(f, [(x,)], reps)
    return 2 * x.nbytes / t


def measure_matmul(reps: int, n: int = 8192) -> float:
    a = jax.random.normal(jax.random.key(1), (n, n), BF16)
    b = jax.random.normal(jax.random.key(2), (n, n), BF16)
    t = timed(lambda x, y: jnp.dot(x, y, preferred_element_type=BF16), [(a, b)], reps)
    return 2 * n**3 / t


def random_parents(rng, b: int, n: int, chain: bool) -> np.ndarray:
    if chain:
        return np.broadcast_to(np.arange(n) - 1, (b, n)).astype(np.int32).copy()
    par = np.zeros((b, n), np.int32)
    par[:, 0] = -1
    for i in range(1, n):
        par[:, i] = rng.integers(max(0, i - 6), i, size=b)  # bushy but several levels deep
    return par


def tree_inputs(seed: int, b: int, n: int, hv: int, chain: bool):
    """``(q, k, v, g, beta, parents, s0)`` of a draft tree of ``n`` nodes (a chain if ``chain``);
    as :func:`chunk_inputs` with ``g = -U(0.01, 0.5)``."""
    q, k, v, g, beta, s0 = chunk_inputs(seed, b, n, hv, g_max=0.5)
    par = jnp.asarray(random_parents(np.random.default_rng(seed), b, n, chain))
    return q, k, v, g, beta, par, s0


def chunk_inputs(
    seed: int, b: int, t: int, hv: int, hk: int = HK, dk: int = K, dv: int = V, g_max: float = 0.2
):
    """``(q, k, v, g, beta, s0)`` of a chunked prefill: bf16 q/k/v ~ N(0, 1), ``g = -U(0.01,
    g_max)``, ``beta = U(0.05, 1)``, ``s0 = 0.1 N(0, 1)`` f32."""
    ks = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(ks[0], (b, t, hk, dk), BF16)
    k = jax.random.normal(ks[1], (b, t, hk, dk), BF16)
    v = jax.random.normal(ks[2], (b, t, hv, dv), BF16)
    g = -jax.random.uniform(ks[3], (b, t, hv), F32, 0.01, g_max)
    beta = jax.random.uniform(ks[4], (b, t, hv), F32, 0.05, 1.0)
    s0 = 0.1 * jax.random.normal(ks[5], (b, hv, dk, dv), F32)
    return q, k, v, g, beta, s0


def deepest_path(par: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    b, n = par.shape
    depth = np.zeros((b, n), np.int32)
    for i in range(n):
        p = par[:, i]
        depth[:, i] = np.where(p >= 0, depth[np.arange(b), np.maximum(p, 0)] + 1, 1)
    d = int(depth.max())
    path = np.full((b, d), 0, np.int32)
    plen = np.zeros((b,), np.int32)
    for r in range(b):
        node = int(np.argmax(depth[r]))
        chain = []
        while node >= 0:
            chain.append(node)
            node = int(par[r, node])
        chain = chain[::-1]
        path[r, : len(chain)] = chain
        plen[r] = len(chain)
    return path, plen


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def verify_bytes(b, n, hv) -> int:
    return (
        b * hv * K * V * 4  # S0
        + 2 * b * n * HK * K * 2  # q, k
        + b * n * hv * V * 2  # v
        + 2 * b * n * hv * 4  # g, beta
        + b * n * 4  # parents
        + b * n * hv * V * (2 + 4)  # O (bf16), U (f32)
        + b * n * hv * 4  # G
    )


def verify_flops(b, n, hv) -> int:
    per_head = 2 * (2 * n * n * K + 2 * n * K * V + n * n * V)  # KK^T, QK^T, KS0, QS0, solve+attn
    return b * hv * per_head


def check_verify(b, n, hv, blocks, snapshot: bool = True) -> float:
    """Largest relative error vs XLA (o and u of Pallas WY, o of the Pallas snapshot kernel) over
    a random tree and a chain."""
    fx = jax.jit(lambda *a: xla_verify(*a, use_qk_l2norm=True, impl="xla"))
    fp = jax.jit(lambda *a: pk.tree_verify(*a, use_qk_l2norm=True, blocks=blocks))
    fs = jax.jit(lambda *a: pk.snapshot_verify(*a, use_qk_l2norm=True))
    errs = []
    for chain in (False, True):
        inp = tree_inputs(100 + chain, b, n, hv, chain)
        ox, cx = fx(*inp)
        op, up, _ = fp(*inp)
        errs.append(max(rel(op, ox), rel(up, cx.u)))
        if snapshot and n == 64 and b * n * hv * K * V * 4 <= 2**32:  # (one N: compile time)
            errs.append(rel(fs(*inp)[0], ox))
    return max(errs)


def pallas_verify(*a, bl):
    """The Pallas verify of one input set (+ its ancestor mask, used by ``ancestors_input``)."""
    anc = a[7] if bl.ancestors_input else None
    return pk.tree_verify(*a[:7], use_qk_l2norm=True, blocks=bl, ancestors=anc)


def check_split(b, n, hv, bl) -> float:
    """Largest relative error vs XLA (o and u) of the two-kernel verify, random tree and chain."""
    fx = jax.jit(lambda *a: xla_verify(*a, use_qk_l2norm=True, impl="xla"))
    fs = jax.jit(functools.partial(split_verify, bl=bl))
    errs = []
    for chain in (False, True):
        inp = tree_inputs(100 + chain, b, n, hv, chain)
        ox, cx = fx(*inp)
        os_, us, _ = fs(*inp, pk.ancestor_mask(inp[5]))
        errs.append(max(rel(os_, ox), rel(us, cx.u)))
    return max(errs)


def split_verify(*a, bl):
    """The two-kernel Pallas verify of one input set (+ its ancestor mask, as :func:`pallas_verify`)."""
    anc = a[7] if bl.ancestors_input else None
    return pk.tree_verify_split(*a[:7], use_qk_l2norm=True, blocks=bl, ancestors=anc)


def bench_verify_split(args, row, sets, csets):
    """``--verify-split``: the two-kernel verify on the same input sets as the fused one."""
    b, n, hv = row["B"], row["N"], row["Hv"]
    split_blocks = parse_blocks(args.verify_split, pk.SplitVerifyBlocks)
    for i, bl in enumerate(split_blocks):
        attempt(row, f"split_rel_err{i}", lambda bl=bl: check_split(b, n, hv, bl))
        attempt(row, f"pallas_split{i}_us", lambda bl=bl: 1e6 * timed_fused(
            functools.partial(split_verify, bl=bl), sets, args.reps))  # fmt: skip
    times = [row.get(f"pallas_split{i}_us", 1e30) for i in range(len(split_blocks))]
    row["pallas_split_us"] = min(times)
    row["split_best_variant"] = times.index(min(times))
    if f"split_rel_err{row['split_best_variant']}" in row:
        row["split_rel_err_vs_xla"] = row[f"split_rel_err{row['split_best_variant']}"]
    if csets is not None:
        bl = split_blocks[row["split_best_variant"]]
        attempt(row, "pallas_split_chain_us", lambda: 1e6 * timed_fused(
            functools.partial(split_verify, bl=bl), csets, args.reps))  # fmt: skip
    if row["pallas_split_us"] < 1e30:
        row["split_over_floor"] = row["pallas_split_us"] / row["floor_us"]
        if row.get("pallas_us", 1e30) < 1e30:
            row["split_over_fused"] = row["pallas_split_us"] / row["pallas_us"]


def bench_verify(args, bw, mm, rows):
    blocks = parse_blocks(args.verify_blocks, pk.VerifyBlocks)
    for hv, b, n in args.configs:
        if True:
            if True:
                byts = verify_bytes(b, n, hv)
                r = n_sets(byts)
                row = dict(op="tree_verify", Hv=hv, B=b, N=n, R=r)
                floor = max(byts / bw, verify_flops(b, n, hv) / mm)
                row["floor_us"] = floor * 1e6
                sets = [tree_inputs(s, b, n, hv, chain=False) for s in range(r)]
                # + the ancestor mask, made once per model step for all layers (ancestors_input)
                sets = [(*x, pk.ancestor_mask(x[5])) for x in sets]
                attempt(row, "rel_err_vs_xla", lambda: check_verify(b, n, hv, blocks[0]))

                for i, bl in enumerate(blocks):
                    if i:
                        attempt(row, f"rel_err{i}", lambda bl=bl: check_verify(
                            b, n, hv, bl, snapshot=False))  # fmt: skip
                    attempt(row, f"pallas{i}_us", lambda bl=bl: 1e6 * timed_fused(
                        functools.partial(pallas_verify, bl=bl), sets, args.reps))  # fmt: skip
                if args.breakdown:
                    for stage in VERIFY_STAGES[1:]:
                        bl = dataclasses.replace(blocks[0], stop_after=stage)
                        attempt(row, f"stage_{stage}_us", lambda bl=bl: 1e6 * timed_fused(
                            functools.partial(pallas_verify, bl=bl), sets, args.reps))  # fmt: skip
                row["pallas_us"] = min(row.get(f"pallas{i}_us", 1e30) for i in range(len(blocks)))
                row["best_variant"] = min(
                    range(len(blocks)), key=lambda i: row.get(f"pallas{i}_us", 1e30))
                csets = None
                if args.chains:  # the deepest tree: every doubling of the depth-adaptive inverse
                    csets = [tree_inputs(s, b, n, hv, chain=True) for s in range(r)]
                    csets = [(*x, pk.ancestor_mask(x[5])) for x in csets]
                    bl = blocks[row["best_variant"]]
                    attempt(row, "pallas_chain_us", lambda bl=bl: 1e6 * timed_fused(
                        functools.partial(pallas_verify, bl=bl), csets, args.reps))  # fmt: skip
                if args.verify_split:
                    bench_verify_split(args, row, sets, csets)
                if not args.no_xla:
                    attempt(row, "xla_us", lambda: 1e6 * timed_fused(
                        lambda *a: xla_verify(*a[:7], use_qk_l2norm=True, impl="xla")[0],
                        sets[: max(4, r // 2)], args.reps,
                    ))  # fmt: skip
                snap_bytes = b * n * hv * K * V * 4
                if not args.no_snapshot and snap_bytes <= args.snapshot_max_gb * 2**30:
                    rs = n_sets(snap_bytes, cap=8)
                    attempt(row, "snapshot_us", lambda: 1e6 * timed_fused(
                        lambda *a: pk.snapshot_verify(*a[:7], use_qk_l2norm=True), sets[:rs],
                        args.reps,
                    ))  # fmt: skip
                row["pallas_over_floor"] = row["pallas_us"] / row["floor_us"]
                if "snapshot_us" in row and row["pallas_us"] < 1e30:
                    row["snapshot_over_pallas"] = row["snapshot_us"] / row["pallas_us"]
                # speculative bytes per draft node, one layer, all heads
                row["wy_bytes_per_node"] = hv * V * 4 + HK * K * 2 + hv * 4 + 4
                row["snapshot_bytes_per_node"] = hv * K * V * 4
                rows.append(row)
                print_row(row)


def bench_commit(args, bw, mm, rows):
    blocks = parse_blocks(args.commit_blocks, pk.CommitBlocks)
    for hv, b, n in args.configs:
        if True:
            if True:
                inp = tree_inputs(7, b, n, hv, chain=False)
                path, plen = deepest_path(np.asarray(inp[5]))
                d = path.shape[1]
                byts = 2 * b * hv * K * V * 4 + b * d * (HK * K * 2 + hv * V * 4 + hv * 4 + 4)
                r = n_sets(byts)
                _, cache = jax.jit(lambda *a: xla_verify(*a, use_qk_l2norm=True, impl="xla"))(*inp)
                s0 = inp[6]
                ref = xla_commit(s0, cache, path, plen, impl="xla")
                got = pk.tree_commit(
                    s0, cache.k, cache.u, cache.g_path, jnp.asarray(path), jnp.asarray(plen),
                    use_qk_l2norm=True, blocks=blocks[0],
                )  # fmt: skip
                row = dict(op="tree_commit", Hv=hv, B=b, N=n, D=d, R=r)
                row["rel_err_vs_xla"] = rel(got, ref)
                row["floor_us"] = 1e6 * byts / bw
                path_j, plen_j = jnp.asarray(path), jnp.asarray(plen)

                def run(fn, r=r, s0=s0):
                    states = [s0 + 0.001 * i for i in range(r)]
                    return 1e6 * timed_fused(fn, states, args.reps, donate=True)

                for i, bl in enumerate(blocks):
                    if i:
                        row[f"rel_err{i}"] = rel(pk.tree_commit(
                            s0, cache.k, cache.u, cache.g_path, jnp.asarray(path),
                            jnp.asarray(plen), use_qk_l2norm=True, blocks=bl), ref)  # fmt: skip
                    attempt(row, f"pallas{i}_us", lambda bl=bl: run(
                        lambda s, bl=bl: pk.tree_commit(
                            s, cache.k, cache.u, cache.g_path, path_j, plen_j,
                            use_qk_l2norm=True, blocks=bl,
                        )
                    ))  # fmt: skip
                row["pallas_us"] = min(row.get(f"pallas{i}_us", 1e30) for i in range(len(blocks)))
                attempt(row, "xla_us", lambda: run(
                    lambda s: xla_commit(s, cache, path_j, plen_j, impl="xla")))  # fmt: skip
                row["pallas_over_floor"] = row["pallas_us"] / row["floor_us"]
                rows.append(row)
                print_row(row)


def bench_arena(args, bw, mm, rows):
    """Verify and commit with the f32 states inside ``uint32`` arenas, read (and written)
    through a handle table by ``pallas_kernels.arena``, against the dense kernels on the same
    inputs and timing (issue 5: what the arena's indirection and bitcast cost the kernels).
    Each input set has its own arena of ``B`` segments, one state per segment, placed by a
    random permutation of the handles."""
    from pallas_kernels import arena as pa

    vb = parse_blocks(args.verify_blocks, pk.VerifyBlocks)[0]
    vb = dataclasses.replace(vb, ancestors_input=False)
    cb = parse_blocks(args.commit_blocks, pk.CommitBlocks)[0]
    for hv, b, n in args.configs:
        r = n_sets(verify_bytes(b, n, hv))
        row = dict(op="arena", Hv=hv, B=b, N=n, R=r)
        sets = [tree_inputs(s, b, n, hv, chain=False) for s in range(r)]
        rng = np.random.default_rng(b * n + hv)
        perm = rng.permutation(b).astype(np.int32)  # handle h lives in segment perm[h]
        table = jnp.asarray(np.stack([perm, np.zeros(b, np.int32)], 1))
        handles_np = rng.permutation(b).astype(np.int32)  # row -> handle
        handles, seg_of_row = jnp.asarray(handles_np), perm[handles_np]

        def arena_of(s0):
            a = jnp.zeros((b, hv * K * V), jnp.uint32)
            return a.at[seg_of_row].set(jax.lax.bitcast_convert_type(s0, jnp.uint32).reshape(b, -1))

        asets = [(*x[:6], arena_of(x[6])) for x in sets]
        o_d, u_d, _ = jax.jit(functools.partial(pallas_verify, bl=vb))(*sets[0])
        o_a, u_a, gp_a = jax.jit(lambda *a: pa.tree_verify(
            *a, table, handles, state_offset=0, use_qk_l2norm=True, blocks=vb,
            interpret=args.dry_run))(*asets[0])  # fmt: skip
        row["verify_rel_diff"] = max(rel(o_a, o_d), rel(u_a, u_d))
        attempt(row, "verify_dense_us", lambda: 1e6 * timed_fused(
            functools.partial(pallas_verify, bl=vb), sets, args.reps))  # fmt: skip
        attempt(row, "verify_arena_us", lambda: 1e6 * timed_fused(
            lambda *a: pa.tree_verify(*a, table, handles, state_offset=0, use_qk_l2norm=True,
                                      blocks=vb, interpret=args.dry_run),
            asets, args.reps))  # fmt: skip
        x = sets[0]
        path, plen = (jnp.asarray(a) for a in deepest_path(np.asarray(x[5])))
        kx = x[1]
        dense_commit = lambda s: pk.tree_commit(
            s, kx, u_d, gp_a, path, plen, use_qk_l2norm=True, blocks=cb)  # fmt: skip
        arena_commit = lambda a: pa.tree_commit(
            a, table, handles, kx, u_d, gp_a, path, plen, state_offset=0, use_qk_l2norm=True,
            blocks=cb, interpret=args.dry_run)  # fmt: skip
        got = jax.jit(arena_commit)(asets[0][6])
        want = jax.jit(dense_commit)(sets[0][6])
        got = jax.lax.bitcast_convert_type(got[seg_of_row].reshape(b, hv, K, V), F32)
        row["commit_rel_diff"] = rel(got, want)
        attempt(row, "commit_dense_us", lambda: 1e6 * timed_fused(
            dense_commit, [x[6] + 0.0 for x in sets], args.reps, donate=True))  # fmt: skip
        attempt(row, "commit_arena_us", lambda: 1e6 * timed_fused(
            arena_commit, [a[6] + 0 for a in asets], args.reps, donate=True))  # fmt: skip
        for op in ("verify", "commit"):
            if f"{op}_dense_us" in row and f"{op}_arena_us" in row:
                row[f"{op}_arena_over_dense"] = row[f"{op}_arena_us"] / row[f"{op}_dense_us"]
        rows.append(row)
        print_row(row)


def _copy_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 1.0


def pallas_copy(s0, block_v: int = 64, interpret: bool = False):
    """The simplest Pallas kernel over the verify's grid: copies the state ``[B, Hv, K, V]``."""
    b, hv, dk, dv = s0.shape
    spec = pl.BlockSpec((None, None, dk, block_v), lambda i, h, j: (i, h, 0, j))
    return pl.pallas_call(
        _copy_kernel, grid=(b, hv, dv // block_v), in_specs=[spec], out_specs=spec,
        out_shape=jax.ShapeDtypeStruct(s0.shape, s0.dtype), interpret=interpret,
        name="state_copy",
    )(s0)  # fmt: skip


def bench_overhead(args, bw, mm, rows):
    """Per-call cost of a trivial Pallas kernel against the same copy in XLA, both timed like
    the verify (``timed_fused``): separates the cost of a Pallas/Triton call in an XLA program
    from kernel work (the session-2 verify timings carry ~100 us per call that ncu does not
    see inside the kernel)."""
    interpret = args.dry_run
    for hv, b, _ in args.configs:
        row = dict(op="overhead", Hv=hv, B=b)
        states = [0.1 * jax.random.normal(jax.random.key(i), (b, hv, K, V), F32)
                  for i in range(n_sets(2 * b * hv * K * V * 4))]  # fmt: skip
        sets = [(x,) for x in states]
        row["R"] = len(sets)
        row["floor_us"] = 1e6 * 2 * states[0].nbytes / bw
        attempt(row, "pallas_copy_us", lambda: 1e6 * timed_fused(
            lambda x: pallas_copy(x, interpret=interpret), sets, args.reps))  # fmt: skip
        attempt(row, "xla_copy_us", lambda: 1e6 * timed_fused(
            lambda x: x * 1.0001, sets, args.reps))  # fmt: skip
        attempt(row, "pallas_copy_single_us", lambda: 1e6 * timed(
            lambda x: pallas_copy(x, interpret=interpret), sets, args.reps))  # fmt: skip
        rows.append(row)
        print_row(row)


def bench_chunk(args, bw, mm, rows):
    blocks = parse_blocks(args.chunk_blocks, pk.ChunkBlocks)
    fla = None
    if not args.no_fla:
        try:
            import torch
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla
            from triton.testing import do_bench
        except Exception as e:  # report and continue without the comparison
            print(f"# fla unavailable: {e!r}", file=sys.stderr)
            fla = None
    hv = args.chunk_hv
    for t, b in args.chunk_shapes:
        args_ = chunk_inputs(t + b, b, t, hv)
        row = dict(op="chunk", Hv=hv, B=b, T=t)
        byts = b * t * (2 * HK * K * 2 + hv * V * 2 * 2 + hv * 8) + 2 * b * hv * K * V * 4
        row["floor_us"] = 1e6 * byts / bw
        ox, sx = jax.jit(lambda *a: xla_chunk(*a, use_qk_l2norm=True, impl="xla"))(*args_)

        def check(args_=args_, ox=ox, sx=sx):
            op, sp = jax.jit(
                lambda *a: pk.chunk_gated_delta_rule(
                    *a, use_qk_l2norm=True, blocks=blocks[0], chunk_size=args.chunk_size
                )
            )(*args_)
            return max(rel(op, ox), rel(sp, sx))

        if not args.no_chunk_v1:
            attempt(row, "rel_err_vs_xla", check)
        for i, bl in enumerate([] if args.no_chunk_v1 else blocks):
            attempt(row, f"pallas{i}_us", lambda bl=bl, args_=args_: 1e6 * timed(
                lambda *a: pk.chunk_gated_delta_rule(
                    *a, use_qk_l2norm=True, blocks=bl, chunk_size=args.chunk_size
                ),
                [args_], args.reps,
            ))  # fmt: skip
        if not args.no_chunk_v1:
            row["pallas_us"] = min(row.get(f"pallas{i}_us", 1e30) for i in range(len(blocks)))
        if args.chunk_v2 or args.chunk_v2_blocks:  # three-kernel prefill (pallas_kernels/chunk_v2)
            v2_blocks = parse_blocks(args.chunk_v2_blocks, pk.ChunkV2Blocks)
            v2 = lambda *a, bl: pk.chunk_gated_delta_rule_v2(
                *a, use_qk_l2norm=True, blocks=bl, chunk_size=args.chunk_v2_size
            )  # fmt: skip

            def check_v2(args_=args_, ox=ox, sx=sx):
                op, sp = jax.jit(functools.partial(v2, bl=v2_blocks[0]))(*args_)
                return max(rel(op, ox), rel(sp, sx))

            attempt(row, "v2_rel_err_vs_xla", check_v2)
            for i, bl in enumerate(v2_blocks):
                attempt(row, f"v2_{i}_us", lambda bl=bl, args_=args_: 1e6 * timed(
                    functools.partial(v2, bl=bl), [args_], args.reps))  # fmt: skip
            row["v2_us"] = min(row.get(f"v2_{i}_us", 1e30) for i in range(len(v2_blocks)))
        if not args.no_xla:
            attempt(row, "xla_us", lambda args_=args_: 1e6 * timed(
                lambda *a: xla_chunk(*a, use_qk_l2norm=True, impl="xla"), [args_], args.reps
            ))  # fmt: skip
        if fla is not None:
            tt = [torch.from_numpy(np.asarray(x.astype(F32))).cuda() for x in args_]
            tq, tk, tv = (x.to(torch.bfloat16) for x in tt[:3])
            tg, tb, ts0 = tt[3], tt[4], tt[5]

            def call(tq=tq, tk=tk, tv=tv, tg=tg, tb=tb, ts0=ts0):
                return fla(
                    tq, tk, tv, tg, tb, initial_state=ts0, output_final_state=True,
                    use_qk_l2norm_in_kernel=True,
                )  # fmt: skip

            def fla_err(call=call, ox=ox, sx=sx):
                of, sf = call()
                return max(rel(of.float().cpu().numpy(), ox), rel(sf.float().cpu().numpy(), sx))

            attempt(row, "fla_rel_err_vs_xla", fla_err)
            attempt(row, "fla_us", lambda call=call: 1e3 * do_bench(
                call, warmup=100, rep=500, return_mode="median"))  # fmt: skip
            if "fla_us" in row and "pallas_us" in row:
                row["pallas_over_fla"] = row["pallas_us"] / row["fla_us"]
            if "fla_us" in row and "v2_us" in row:
                row["v2_over_fla"] = row["v2_us"] / row["fla_us"]
        rows.append(row)
        print_row(row)


def parse_value(val: str):
    if val.lower() in ("true", "false"):
        return val.lower() == "true"
    try:
        return int(val)
    except ValueError:
        return val


def parse_blocks(specs: list[str], cls):
    out = []
    for spec in specs:
        kw = dict(item.split("=") for item in filter(None, spec.split(",")))
        out.append(cls(**{key: parse_value(val) for key, val in kw.items()}))
    return out or [cls()]


_AFTER_ROW = []  # callbacks run after each printed row (main: write the JSON so far)


def print_row(row):
    for fn in _AFTER_ROW:
        fn()
    cells = []
    for key, val in row.items():
        cells.append(f"{key}={val:.3g}" if isinstance(val, float) else f"{key}={val}")
    print("  ".join(cells), flush=True)


def table(rows, cols):
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c, "")
            cells.append(f"{v:.3g}" if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def dump(args, dev, bw, mm, rows) -> None:
    meta = dict(device=dev.device_kind, jax=jax.__version__, hbm_bytes_per_s=bw, bf16_flops=mm)
    with open(args.json, "w") as f:
        json.dump(dict(meta=meta, args=vars(args), rows=rows), f, indent=1, default=str)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hv", type=ints, default=[32, 64], help="value heads (Hk = 16)")
    p.add_argument("--batch", type=ints, default=[1, 16, 64])
    p.add_argument("--nodes", type=ints, default=[8, 32, 64, 128])
    p.add_argument(
        "--configs", default="",
        help="explicit 'Hv:B:N' list, e.g. '32:16:64;64:1:64' (default: --hv x --batch x --nodes)",
    )  # fmt: skip
    p.add_argument("--reps", type=int, default=10)
    p.add_argument(
        "--ops", default="verify,commit,chunk",
        help="comma list of verify, commit, arena, chunk, overhead (a trivial Pallas copy vs XLA)",
    )  # fmt: skip
    p.add_argument(
        "--verify-blocks", action="append", default=[],
        help="VerifyBlocks fields, e.g. 'block_v=128,num_warps=8,precision=tf32x3'; repeatable",
    )  # fmt: skip
    p.add_argument(
        "--verify-split", action="append", nargs="?", const="", default=[],
        help="also time the two-kernel verify (pk.tree_verify_split) next to the fused one; an\n"
        "optional SplitVerifyBlocks spec, e.g. 'block_v=128,num_warps_b=8,precision=bf16x3';\n"
        "repeatable (variants; the bare flag: default knobs)",
    )  # fmt: skip
    p.add_argument("--commit-blocks", action="append", default=[])
    p.add_argument("--chunk-blocks", action="append", default=[])
    p.add_argument(
        "--chunk-shapes", type=lambda s: [tuple(ints(x.replace("x", ","))) for x in s.split(";")],
        default=[(4096, 1), (4096, 8), (16384, 2)], help="'T x B' pairs, e.g. '4096x1;16384x2'",
    )  # fmt: skip
    p.add_argument("--chunk-hv", type=int, default=32)
    p.add_argument("--chunk-size", type=int, default=32, help="64 does not build on the H200")
    p.add_argument("--chunk-v2", action="store_true", help="also time pk.chunk_gated_delta_rule_v2")
    p.add_argument(
        "--chunk-v2-blocks", action="append", default=[],
        help="ChunkV2Blocks fields, e.g. 'block_v_state=16,h_bf16=true'; repeatable; implies --chunk-v2",
    )  # fmt: skip
    p.add_argument("--chunk-v2-size", type=int, default=64)
    p.add_argument("--snapshot-max-gb", type=float, default=40.0)
    p.add_argument("--no-snapshot", action="store_true")
    p.add_argument("--no-xla", action="store_true")
    p.add_argument("--no-fla", action="store_true")
    p.add_argument("--chains", action="store_true",
                   help="also time the best verify variant on chains (depth N)")  # fmt: skip
    p.add_argument("--no-chunk-v1", action="store_true", help="skip the session-1 one-kernel chunk")
    p.add_argument("--json", default="kernels.json")
    p.add_argument(
        "--dry-run", action="store_true",
        help="CPU check of this script: kernels in interpret mode, tiny ceiling measurements",
    )  # fmt: skip
    p.add_argument(
        "--breakdown", action="store_true",
        help="also time the verify kernel cut after each stage (VerifyBlocks.stop_after)",
    )  # fmt: skip
    p.add_argument(
        "--gpu-max-nodes", type=int, default=0,
        help="let the x3-mode verify kernel try N up to this many nodes on GPU (its limit: 64)",
    )  # fmt: skip
    p.add_argument("--watchdog", type=float, default=0, help="dump stacks every this many s")
    args = p.parse_args(argv)
    if args.configs:
        args.configs = [tuple(ints(c.replace(":", ","))) for c in args.configs.split(";")]
    else:
        args.configs = [(h, b, n) for h in args.hv for b in args.batch for n in args.nodes]
    if args.watchdog:
        import faulthandler

        faulthandler.dump_traceback_later(args.watchdog, repeat=True)

    if args.gpu_max_nodes:
        # (the package's ``tree_verify`` attribute is the function, so go through sys.modules)
        sys.modules["pallas_kernels.tree_verify"].GPU_MAX_NODES_X3 = args.gpu_max_nodes
    dev = jax.devices()[0]
    log("measuring bandwidth and matmul rate")
    if args.dry_run:
        for name in ("tree_verify", "tree_commit", "snapshot_verify", "chunk_gated_delta_rule",
                     "chunk_gated_delta_rule_v2", "tree_verify_split"):  # fmt: skip
            setattr(pk, name, functools.partial(getattr(pk, name), interpret=True))
    bw = measure_bandwidth(args.reps, 1 << 20 if args.dry_run else 256 << 20)
    mm = measure_matmul(args.reps, 256 if args.dry_run else 8192)
    print(f"# device {dev.device_kind}; jax {jax.__version__}")
    print(
        f"# HBM bandwidth {bw / 1e12:.2f} TB/s (copy, read+write); bf16 matmul {mm / 1e12:.0f} TFLOP/s"
    )
    rows: list[dict] = []
    ops = args.ops.split(",")
    _AFTER_ROW.append(lambda: dump(args, dev, bw, mm, rows))
    benches = (("overhead", bench_overhead), ("verify", bench_verify), ("commit", bench_commit),
               ("arena", bench_arena),
               ("chunk", bench_chunk))  # fmt: skip
    for name, bench in benches:
        if name in ops:
            try:
                bench(args, bw, mm, rows)
            except Exception as e:  # report and go on with the next op
                print(f"# {name} failed: {type(e).__name__}: {e}", file=sys.stderr)
            dump(args, dev, bw, mm, rows)
    orows = [r for r in rows if r["op"] == "overhead"]
    if orows:
        print("\n## per-call cost: trivial Pallas copy vs XLA copy of the state (us per call)\n")
        print(table(orows, ["Hv", "B", "R", "pallas_copy_us", "xla_copy_us",
                            "pallas_copy_single_us", "floor_us"]))  # fmt: skip
    vr = [r for r in rows if r["op"] == "tree_verify"]
    if vr and args.breakdown:
        print("\n## tree_verify cut after each stage (us; variant 0)\n")
        stages = [f"stage_{st}_us" for st in VERIFY_STAGES[1:]]
        print(table(vr, ["Hv", "B", "N", *stages, "pallas0_us"]))
    if vr:
        print("\n## tree_verify (us per layer)\n")
        split_cols = (["pallas_split_us", "split_over_fused", "split_rel_err_vs_xla"]
                      if args.verify_split else [])  # fmt: skip
        print(table(vr, ["Hv", "B", "N", "pallas_us", *split_cols, "pallas_chain_us", "xla_us",
                         "snapshot_us", "floor_us",
                         "pallas_over_floor", "snapshot_over_pallas", "rel_err_vs_xla",
                         "best_variant"]))  # fmt: skip
        nv = max(len(args.verify_blocks), 1)
        if nv > 1:
            print("\n## tree_verify variants (us; rel err vs XLA)\n")
            for i, spec in enumerate(args.verify_blocks):
                print(f"- variant {i}: {spec}")
            cols = [f"pallas{i}_us" for i in range(nv)] + [f"rel_err{i}" for i in range(1, nv)]
            print(table(vr, ["Hv", "B", "N", *cols]))
        ns = len(args.verify_split)
        if ns:
            print("\n## tree_verify_split: two kernels vs fused (us; rel err vs XLA)\n")
            for i, spec in enumerate(args.verify_split):
                print(f"- split variant {i}: {spec or '(default SplitVerifyBlocks)'}")
            cols = [f"pallas_split{i}_us" for i in range(ns)]
            cols += [f"split_rel_err{i}" for i in range(ns)]
            print(table(vr, ["Hv", "B", "N", "pallas_us", *cols, "pallas_split_chain_us",
                             "split_over_fused", "split_over_floor", "floor_us"]))  # fmt: skip
        print("\n## speculative memory per draft node, one layer (bytes)\n")
        mem = {(r["Hv"]): r for r in vr}
        print("| Hv | WY (U, k, G, parent) | snapshot (K x V state) | ratio |\n|---|---|---|---|")
        for hv, r in mem.items():
            w, s = r["wy_bytes_per_node"], r["snapshot_bytes_per_node"]
            print(f"| {hv} | {w} | {s} | {s / w:.0f}x |")
    cr = [r for r in rows if r["op"] == "tree_commit"]
    if cr:
        print("\n## tree_commit (us per layer)\n")
        print(table(cr, ["Hv", "B", "N", "D", "pallas_us", "xla_us", "floor_us",
                         "pallas_over_floor", "rel_err_vs_xla"]))  # fmt: skip
        nc = max(len(args.commit_blocks), 1)
        if nc > 1:
            for i, spec in enumerate(args.commit_blocks):
                print(f"- commit variant {i}: {spec}")
            cols = [f"pallas{i}_us" for i in range(nc)] + [f"rel_err{i}" for i in range(1, nc)]
            print(table(cr, ["Hv", "B", "N", *cols]))
    ar = [r for r in rows if r["op"] == "arena"]
    if ar:
        print("\n## states in the arena (pallas_kernels.arena) vs dense (us per layer)\n")
        print(table(ar, ["Hv", "B", "N", "verify_dense_us", "verify_arena_us",
                         "verify_arena_over_dense", "commit_dense_us", "commit_arena_us",
                         "commit_arena_over_dense", "verify_rel_diff", "commit_rel_diff"]))  # fmt: skip
    pr = [r for r in rows if r["op"] == "chunk"]
    if pr:
        print("\n## chunk prefill (us per layer)\n")
        print(table(pr, ["Hv", "B", "T", "pallas_us", "v2_us", "fla_us", "xla_us", "floor_us",
                         "pallas_over_fla", "v2_over_fla", "rel_err_vs_xla", "v2_rel_err_vs_xla",
                         "fla_rel_err_vs_xla"]))  # fmt: skip


if __name__ == "__main__":
    main()
