"""The Pallas GDN kernels on one GPU against the XLA path, the snapshot kernel, fla and the floor.

Ops (``--ops``, a comma list):

- ``verify``: tree WY verify (``pallas_kernels.verify``; variants by ``--verify-blocks``, on
  random trees and with ``--chains`` on chains) against the XLA path, the fused Pallas
  snapshot verify and the floor; ``--verify-split`` adds the two-kernel verify
  (``pallas_kernels.experimental.verify_split``), ``--verify-mgpu`` the Mosaic GPU verify
  (``pallas_kernels.verify.mgpu``), ``--breakdown`` the kernel cut after each
  stage (``VerifyBlocks.stop_after``). Also the speculative bytes per draft node, WY against
  snapshot.
- ``commit``: tree commit in place (``pallas_kernels.commit``; ``--commit-blocks``) against XLA.
- ``arena``: verify and commit with the f32 states in ``uint32`` arenas, read (and written)
  through a handle table (``verify/arena.py``, ``commit/arena.py``), against the dense kernels:
  what the arena's indirection and bitcast cost.
- ``chunk``: the chunked prefill (``pallas_kernels.chunk``; ``--chunk-blocks``) against XLA and
  flash-linear-attention's Triton ``chunk_gated_delta_rule`` (when importable; timed with
  ``triton.testing.do_bench``).
- ``overhead``: one jitted program running an op on ``R`` input sets for each ``R`` in ``--rs``,
  fitted as ``time = fixed + R * per_op``: the device time per op and the program's fixed cost
  (dispatch, argument handling, synchronisation) of the Pallas verify, the XLA verify, a trivial
  Pallas copy of the state over the verify's grid, and a one-tile Pallas call against an XLA
  fusion of the same size (the cost of launching a kernel).
- ``profile``: no timing: each ``--verify-blocks`` variant run twice at each config, for an
  external profiler (``ncu -k regex:gdn_tree_verify``).

Inputs: bf16 q/k/v, f32 g/beta/state, ``use_qk_l2norm=True``, Hk 16, K = V = 128; trees with
each parent drawn from the 6 previous nodes. Every timed verify/commit config is also checked
against XLA (relative error, random tree and chain). The floor of an op is ``max(bytes / HBM
bandwidth, flops / bf16 matmul rate)``, both measured at the start of the run.

Timing: verify, commit and arena run the op on ``R`` distinct input sets (up to 16, up to 2 GB,
rotating past the L2) inside one jitted program, kernels back to back as the layers of a model
step, and report the marginal cost per op ``(t(R) - t(1)) / (R - 1)`` (medians over ``--reps``):
the program's fixed cost is paid once per model step, not per layer. The chunked prefill is timed
per call: back-to-back asynchronous calls, one block at the end.

    python -m benchmarks.kernels --ops verify --configs "32:16:64;64:1:64" --chains \\
        --verify-blocks precision=bf16x3 --json verify.json
    python -m benchmarks.kernels --dry-run --configs 32:1:8 --chunk-shapes 64x1   # CPU check
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
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
from benchmarks.common import ints, log, markdown_table, parse_blocks, rel, write_json  # noqa: E402
from benchmarks.timing import measure_bandwidth, measure_matmul, timed  # noqa: E402
from gdn_jax.chunk import chunk_gated_delta_rule as xla_chunk  # noqa: E402
from gdn_jax.tree_wy import tree_commit as xla_commit  # noqa: E402
from gdn_jax.tree_wy import tree_verify as xla_verify  # noqa: E402
from pallas_kernels.commit import arena as commit_arena  # noqa: E402
from pallas_kernels.experimental import verify_split as split  # noqa: E402
from pallas_kernels.verify import arena as verify_arena  # noqa: E402
from pallas_kernels.verify import kernel as verify_kernel  # noqa: E402
from pallas_kernels.verify import mgpu as verify_mgpu  # noqa: E402

K = V = 128
HK = 16
BF16, F32 = jnp.bfloat16, jnp.float32
OPS = ("overhead", "profile", "verify", "commit", "arena", "chunk")

# --------------------------------------------------------------------------------------- timing


def program_time(fn, sets, reps: int, donate: bool = False) -> tuple[float, list]:
    """``(median seconds, sets)`` of one jitted program running ``fn`` on every input set back to
    back. With ``donate`` each set is one array updated in place (``fn`` returns the new array),
    and the sets returned are the updated ones."""

    def run(xs):
        return [fn(*x) if isinstance(x, tuple) else fn(x) for x in xs]

    f = jax.jit(run, donate_argnums=0 if donate else ())
    state = list(sets)
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
    return statistics.median(ts), state


def timed_fused(fn, sets, reps: int, donate: bool = False) -> float:
    """Seconds per op in one jitted program over every input set (:func:`program_time`): with
    four or more sets the marginal cost ``(t(R) - t(1)) / (R - 1)``, else ``t(R) / R``."""
    r = len(sets)
    t_r, sets = program_time(fn, sets, reps, donate)
    if r < 4:
        return t_r / r
    t_1, _ = program_time(fn, sets[:1], reps, donate)
    return max(t_r - t_1, 0.0) / (r - 1)


def fused_us(fn, sets, reps: int, donate: bool = False) -> float:
    """:func:`timed_fused` in microseconds."""
    return 1e6 * timed_fused(fn, sets, reps, donate)


def call_us(fn, sets, reps: int) -> float:
    """:func:`timed` in microseconds."""
    return 1e6 * timed(fn, sets, reps)


def attempt(row: dict, key: str, fn, *args, **kwargs) -> None:
    """``row[key] = fn(*args, **kwargs)``; a failure is recorded in the row (``key_error``)
    instead of ending the run."""
    t0 = time.perf_counter()
    try:
        row[key] = fn(*args, **kwargs)
        log(f"{row.get('op')} {key} = {row[key]:.4g} ({time.perf_counter() - t0:.1f} s)")
    except Exception as e:  # keep the other measurements of the run
        row[key + "_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(f"# {row.get('op')} {key} failed: {row[key + '_error']}", file=sys.stderr)


def best_of(row: dict, prefix: str, count: int) -> tuple[float, int]:
    """``(smallest row[f"{prefix}{i}_us"], its i)`` over the variants (1e30 if none ran)."""
    times = [row.get(f"{prefix}{i}_us", 1e30) for i in range(count)]
    return min(times), times.index(min(times))


def rel_err_key(i: int) -> str:
    """The row key of variant ``i``'s relative error against XLA."""
    return f"rel_err{i}" if i else "rel_err_vs_xla"


def n_sets(bytes_per_call: int, cap: int = 16) -> int:
    """Input sets per program: up to ``cap``, up to 2 GB in all."""
    return int(min(cap, max(1, (2 << 30) // max(bytes_per_call, 1))))


# --------------------------------------------------------------------------------------- inputs


def random_parents(rng, b: int, n: int, chain: bool) -> np.ndarray:
    """Parents ``[b, n]`` of a chain, or of random trees (each parent among the 6 previous nodes:
    bushy but several levels deep)."""
    if chain:
        return np.broadcast_to(np.arange(n) - 1, (b, n)).astype(np.int32).copy()
    par = np.zeros((b, n), np.int32)
    par[:, 0] = -1
    for i in range(1, n):
        par[:, i] = rng.integers(max(0, i - 6), i, size=b)
    return par


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


def tree_inputs(seed: int, b: int, n: int, hv: int, chain: bool):
    """``(q, k, v, g, beta, parents, s0)`` of a draft tree of ``n`` nodes (a chain if ``chain``);
    as :func:`chunk_inputs` with ``g = -U(0.01, 0.5)``."""
    q, k, v, g, beta, s0 = chunk_inputs(seed, b, n, hv, g_max=0.5)
    par = jnp.asarray(random_parents(np.random.default_rng(seed), b, n, chain))
    return q, k, v, g, beta, par, s0


def with_ancestors(sets):
    """Each input set plus its ancestor mask (made once per model step for all layers; read by
    ``VerifyBlocks(ancestors_input=True)``)."""
    return [(*x, pk.ancestor_mask(x[5])) for x in sets]


def deepest_path(par: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(path [b, D], length [b])``: each row's root-to-deepest-node path."""
    b, n = par.shape
    depth = np.zeros((b, n), np.int32)
    for i in range(n):
        p = par[:, i]
        depth[:, i] = np.where(p >= 0, depth[np.arange(b), np.maximum(p, 0)] + 1, 1)
    path = np.zeros((b, int(depth.max())), np.int32)
    plen = np.zeros((b,), np.int32)
    for r in range(b):
        node, chain = int(np.argmax(depth[r])), []
        while node >= 0:
            chain.append(node)
            node = int(par[r, node])
        path[r, : len(chain)] = chain[::-1]
        plen[r] = len(chain)
    return path, plen


def verify_bytes(b, n, hv) -> int:
    """HBM bytes of one verify: S0, q/k/v/g/beta/parents read, O (bf16), U (f32), G written."""
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
    """Matmul flops of one verify: K K^T, Q K^T, K S0, Q S0, the solve and the attention."""
    return b * hv * 2 * (2 * n * n * K + 2 * n * K * V + n * n * V)


# --------------------------------------------------------------------------------------- verify


def pallas_verify(*a, bl):
    """The Pallas verify of one input set (+ its ancestor mask, read with ``ancestors_input``)."""
    anc = a[7] if bl.ancestors_input else None
    return pk.tree_verify(*a[:7], use_qk_l2norm=True, blocks=bl, ancestors=anc)


def split_verify(*a, bl):
    """The two-kernel Pallas verify of one input set (as :func:`pallas_verify`)."""
    anc = a[7] if bl.ancestors_input else None
    return split.tree_verify_split(*a[:7], use_qk_l2norm=True, blocks=bl, ancestors=anc)


def xla_verify_o(*a):
    """The XLA verify's output of one input set."""
    return xla_verify(*a[:7], use_qk_l2norm=True, impl="xla")[0]


def snapshot_o(*a):
    """The Pallas snapshot verify's output of one input set."""
    return pk.snapshot_verify(*a[:7], use_qk_l2norm=True)


def check_verify(b, n, hv, op, snapshot: bool = False) -> float:
    """Largest relative error against XLA of ``op``'s ``o`` and ``u`` (``op``: one input set
    with its ancestor mask -> ``(o, u, g_path)``) over a random tree and a chain; with
    ``snapshot`` also the snapshot kernel's ``o`` (at N = 64 only: compile time)."""
    fx = jax.jit(lambda *a: xla_verify(*a, use_qk_l2norm=True, impl="xla"))
    fp = jax.jit(op)
    fs = jax.jit(snapshot_o)
    errs = []
    for chain in (False, True):
        inp = tree_inputs(100 + chain, b, n, hv, chain)
        ox, cx = fx(*inp)
        op_, up, _ = fp(*inp, pk.ancestor_mask(inp[5]))
        errs.append(max(rel(op_, ox), rel(up, cx.u)))
        if snapshot and n == 64 and b * n * hv * K * V * 4 <= 2**32:
            errs.append(rel(fs(*inp)[0], ox))
    return max(errs)


def mgpu_verify(*a, bl):
    """The Mosaic GPU verify of one input set, with its ancestor mask."""
    return verify_mgpu.tree_verify_mgpu(*a[:7], use_qk_l2norm=True, blocks=bl, ancestors=a[7])


# the other verify builds timed on the fused kernel's input sets: option, knobs, op
OTHER_VERIFY = {
    "split": ("verify_split", split.SplitVerifyBlocks, split_verify),
    "mgpu": ("verify_mgpu", verify_mgpu.MgpuVerifyBlocks, mgpu_verify),
}


def bench_verify_other(args, row, sets, csets, kind: str):
    """``--verify-split`` / ``--verify-mgpu``: the two-kernel or the Mosaic GPU verify on the
    same input sets as the fused one (row keys ``pallas_<kind>_us``, ``<kind>_over_fused``...)."""
    b, n, hv = row["B"], row["N"], row["Hv"]
    option, cls, fn = OTHER_VERIFY[kind]
    variants = parse_blocks(getattr(args, option), cls)
    for i, bl in enumerate(variants):
        op = functools.partial(fn, bl=bl)
        attempt(row, f"{kind}_rel_err{i}", check_verify, b, n, hv, op)
        attempt(row, f"pallas_{kind}{i}_us", fused_us, op, sets, args.reps)
    row[f"pallas_{kind}_us"], best = best_of(row, f"pallas_{kind}", len(variants))
    row[f"{kind}_best_variant"] = best
    if f"{kind}_rel_err{best}" in row:
        row[f"{kind}_rel_err_vs_xla"] = row[f"{kind}_rel_err{best}"]
    if csets is not None:
        op = functools.partial(fn, bl=variants[best])
        attempt(row, f"pallas_{kind}_chain_us", fused_us, op, csets, args.reps)
    if row[f"pallas_{kind}_us"] < 1e30:
        row[f"{kind}_over_floor"] = row[f"pallas_{kind}_us"] / row["floor_us"]
        if row.get("pallas_us", 1e30) < 1e30:
            row[f"{kind}_over_fused"] = row[f"pallas_{kind}_us"] / row["pallas_us"]


def bench_verify_config(args, bw, mm, blocks, hv, b, n) -> dict:
    """One ``tree_verify`` row."""
    byts = verify_bytes(b, n, hv)
    r = n_sets(byts)
    row = dict(op="tree_verify", Hv=hv, B=b, N=n, R=r)
    row["floor_us"] = 1e6 * max(byts / bw, verify_flops(b, n, hv) / mm)
    sets = with_ancestors([tree_inputs(s, b, n, hv, chain=False) for s in range(r)])
    for i, bl in enumerate(blocks):
        op = functools.partial(pallas_verify, bl=bl)
        attempt(row, rel_err_key(i), check_verify, b, n, hv, op, snapshot=i == 0)
        attempt(row, f"pallas{i}_us", fused_us, op, sets, args.reps)
    if args.breakdown:
        for stage in verify_kernel.STAGES[1:]:
            op = functools.partial(
                pallas_verify, bl=dataclasses.replace(blocks[0], stop_after=stage)
            )
            attempt(row, f"stage_{stage}_us", fused_us, op, sets, args.reps)
    row["pallas_us"], row["best_variant"] = best_of(row, "pallas", len(blocks))
    csets = None
    if args.chains:  # the deepest tree: every doubling of the depth-adaptive inverse
        csets = with_ancestors([tree_inputs(s, b, n, hv, chain=True) for s in range(r)])
        op = functools.partial(pallas_verify, bl=blocks[row["best_variant"]])
        attempt(row, "pallas_chain_us", fused_us, op, csets, args.reps)
    for kind, (option, _, _) in OTHER_VERIFY.items():
        if getattr(args, option):
            bench_verify_other(args, row, sets, csets, kind)
    if not args.no_xla:
        attempt(row, "xla_us", fused_us, xla_verify_o, sets[: max(4, r // 2)], args.reps)
    snap_bytes = b * n * hv * K * V * 4
    if not args.no_snapshot and snap_bytes <= args.snapshot_max_gb * 2**30:
        rs = n_sets(snap_bytes, cap=8)
        attempt(row, "snapshot_us", fused_us, snapshot_o, sets[:rs], args.reps)
    row["pallas_over_floor"] = row["pallas_us"] / row["floor_us"]
    if "snapshot_us" in row and row["pallas_us"] < 1e30:
        row["snapshot_over_pallas"] = row["snapshot_us"] / row["pallas_us"]
    # speculative bytes per draft node, one layer, all heads
    row["wy_bytes_per_node"] = hv * V * 4 + HK * K * 2 + hv * 4 + 4
    row["snapshot_bytes_per_node"] = hv * K * V * 4
    return row


def bench_verify(args, bw, mm, emit):
    blocks = parse_blocks(args.verify_blocks, pk.VerifyBlocks)
    for hv, b, n in args.configs:
        emit(bench_verify_config(args, bw, mm, blocks, hv, b, n))


# --------------------------------------------------------------------------------------- commit


def bench_commit_config(args, bw, blocks, hv, b, n) -> dict:
    """One ``tree_commit`` row: the deepest path of a random tree, state updated in place."""
    inp = tree_inputs(7, b, n, hv, chain=False)
    path, plen = (jnp.asarray(x) for x in deepest_path(np.asarray(inp[5])))
    d = path.shape[1]
    byts = 2 * b * hv * K * V * 4 + b * d * (HK * K * 2 + hv * V * 4 + hv * 4 + 4)
    r = n_sets(byts)
    _, cache = jax.jit(lambda *a: xla_verify(*a, use_qk_l2norm=True, impl="xla"))(*inp)
    s0 = inp[6]
    ref = xla_commit(s0, cache, path, plen, impl="xla")
    row = dict(op="tree_commit", Hv=hv, B=b, N=n, D=d, R=r, floor_us=1e6 * byts / bw)

    def commit_us(op):  # fresh states each time: the program donates them
        return fused_us(op, [s0 + 0.001 * i for i in range(r)], args.reps, donate=True)

    def pallas(s, bl):
        return pk.tree_commit(
            s, cache.k, cache.u, cache.g_path, path, plen, use_qk_l2norm=True, blocks=bl
        )

    for i, bl in enumerate(blocks):
        row[rel_err_key(i)] = rel(pallas(s0, bl), ref)
        op = functools.partial(pallas, bl=bl)
        attempt(row, f"pallas{i}_us", commit_us, op)
    row["pallas_us"], row["best_variant"] = best_of(row, "pallas", len(blocks))
    op = lambda s: xla_commit(s, cache, path, plen, impl="xla")
    attempt(row, "xla_us", commit_us, op)
    row["pallas_over_floor"] = row["pallas_us"] / row["floor_us"]
    return row


def bench_commit(args, bw, mm, emit):
    blocks = parse_blocks(args.commit_blocks, pk.CommitBlocks)
    for hv, b, n in args.configs:
        emit(bench_commit_config(args, bw, blocks, hv, b, n))


# ---------------------------------------------------------------------------------------- arena


def bench_arena_config(args, vb, cb, hv, b, n) -> dict:
    """One ``arena`` row. Each input set has its own arena of ``B`` segments, one state per
    segment, placed by a random permutation of the handles."""
    r = n_sets(verify_bytes(b, n, hv))
    row = dict(op="arena", Hv=hv, B=b, N=n, R=r)
    sets = [tree_inputs(s, b, n, hv, chain=False) for s in range(r)]
    rng = np.random.default_rng(b * n + hv)
    perm = rng.permutation(b).astype(np.int32)  # handle h lives in segment perm[h]
    table = jnp.asarray(np.stack([perm, np.zeros(b, np.int32)], 1))
    handles_np = rng.permutation(b).astype(np.int32)  # row -> handle
    handles, seg_of_row = jnp.asarray(handles_np), perm[handles_np]

    def arena_of(s0):
        words = jax.lax.bitcast_convert_type(s0, jnp.uint32).reshape(b, -1)
        return jnp.zeros((b, hv * K * V), jnp.uint32).at[seg_of_row].set(words)

    asets = [(*x[:6], arena_of(x[6])) for x in sets]
    dense_verify = functools.partial(pallas_verify, bl=vb)

    def arena_verify(*a):
        return verify_arena.tree_verify(
            *a,
            table,
            handles,
            state_offset=0,
            use_qk_l2norm=True,
            blocks=vb,
            interpret=args.dry_run,
        )

    o_d, u_d, _ = jax.jit(dense_verify)(*sets[0])
    o_a, u_a, gp_a = jax.jit(arena_verify)(*asets[0])
    row["verify_rel_diff"] = max(rel(o_a, o_d), rel(u_a, u_d))
    attempt(row, "verify_dense_us", fused_us, dense_verify, sets, args.reps)
    attempt(row, "verify_arena_us", fused_us, arena_verify, asets, args.reps)

    x = sets[0]
    path, plen = (jnp.asarray(a) for a in deepest_path(np.asarray(x[5])))
    commit_args = (x[1], u_d, gp_a, path, plen)

    def dense_commit(s):
        return pk.tree_commit(s, *commit_args, use_qk_l2norm=True, blocks=cb)

    def arena_commit(a):
        return commit_arena.tree_commit(
            a,
            table,
            handles,
            *commit_args,
            state_offset=0,
            use_qk_l2norm=True,
            blocks=cb,
            interpret=args.dry_run,
        )

    got = jax.jit(arena_commit)(asets[0][6])
    want = jax.jit(dense_commit)(sets[0][6])
    got = jax.lax.bitcast_convert_type(got[seg_of_row].reshape(b, hv, K, V), F32)
    row["commit_rel_diff"] = rel(got, want)
    dense_states = [x[6] + 0.0 for x in sets]
    arena_states = [a[6] + 0 for a in asets]
    attempt(row, "commit_dense_us", fused_us, dense_commit, dense_states, args.reps, donate=True)
    attempt(row, "commit_arena_us", fused_us, arena_commit, arena_states, args.reps, donate=True)
    for op in ("verify", "commit"):
        if f"{op}_dense_us" in row and f"{op}_arena_us" in row:
            row[f"{op}_arena_over_dense"] = row[f"{op}_arena_us"] / row[f"{op}_dense_us"]
    return row


def bench_arena(args, bw, mm, emit):
    vb = parse_blocks(args.verify_blocks, pk.VerifyBlocks)[0]
    vb = dataclasses.replace(vb, ancestors_input=False)
    cb = parse_blocks(args.commit_blocks, pk.CommitBlocks)[0]
    for hv, b, n in args.configs:
        emit(bench_arena_config(args, vb, cb, hv, b, n))


# ------------------------------------------------------------------------------------- overhead


def _copy_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 1.0001


def pallas_copy(s0, block_v: int = 64, interpret: bool = False):
    """The simplest Pallas kernel over the verify's grid: copies the state ``[B, Hv, K, V]``."""
    b, hv, dk, dv = s0.shape
    spec = pl.BlockSpec((None, None, dk, block_v), lambda i, h, j: (i, h, 0, j))
    return pl.pallas_call(
        _copy_kernel,
        grid=(b, hv, dv // block_v),
        in_specs=[spec],
        out_specs=spec,
        out_shape=jax.ShapeDtypeStruct(s0.shape, s0.dtype),
        interpret=interpret,
        name="state_copy",
    )(s0)


def pallas_tiny(s0, interpret: bool = False):
    """One program copying one 8 x 128 tile of the state: the cost of launching a Pallas call."""
    return pl.pallas_call(
        _copy_kernel,
        grid=(1,),
        in_specs=[pl.BlockSpec((None, None, 8, 128), lambda i: (0, 0, 0, 0))],
        out_specs=pl.BlockSpec((8, 128), lambda i: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((8, 128), s0.dtype),
        interpret=interpret,
        name="tiny",
    )(s0)


def verify_variants(args) -> list[tuple[str, pk.VerifyBlocks]]:
    """``(spec, VerifyBlocks)`` of every ``--verify-blocks`` (one with the defaults if none)."""
    specs = args.verify_blocks or [""]
    return list(zip(specs, parse_blocks(specs, pk.VerifyBlocks), strict=True))


def overhead_ops(args) -> dict:
    """The ``overhead`` op's programs, by name, each of one input set."""
    interpret = args.dry_run
    ops = {}
    for spec, bl in verify_variants(args):
        ops[f"pallas[{spec}]"] = functools.partial(pallas_verify, bl=bl)
    ops["xla"] = xla_verify_o
    ops["pallas_copy"] = lambda *a: pallas_copy(a[6], interpret=interpret)
    ops["xla_copy"] = lambda *a: a[6] * 1.0001
    ops["pallas_tiny"] = lambda *a: pallas_tiny(a[6], interpret=interpret)
    ops["xla_tiny"] = lambda *a: a[6][0, 0, :8] * 1.0001
    keep = set(filter(None, args.overhead_ops.split(",")))
    return {name: op for name, op in ops.items() if not keep or name in keep}


def bench_overhead(args, bw, mm, emit):
    """Per op: program time for each ``R`` of ``--rs``, fitted as ``fixed + R * per_op``."""
    for hv, b, n in args.configs:
        sets = with_ancestors([tree_inputs(i, b, n, hv, chain=False) for i in range(max(args.rs))])
        for name, op in overhead_ops(args).items():
            row = dict(op="overhead", Hv=hv, B=b, N=n, name=name, rs=args.rs)
            try:
                ts = [program_time(op, sets[:r], args.reps)[0] for r in args.rs]
            except Exception as e:  # keep the other ops of the run
                print(
                    f"# overhead {name} failed: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr
                )
                continue
            slope, intercept = np.polyfit(np.asarray(args.rs, float), np.asarray(ts), 1)
            row["program_us"] = [1e6 * t for t in ts]
            row["slope_us"], row["intercept_us"] = 1e6 * float(slope), 1e6 * float(intercept)
            emit(row)


def bench_profile(args, bw, mm, emit):
    """Each verify variant run twice per config, untimed, for an external profiler."""
    for hv, b, n in args.configs:
        x = with_ancestors([tree_inputs(0, b, n, hv, chain=False)])[0]
        for spec, bl in verify_variants(args):
            f = jax.jit(functools.partial(pallas_verify, bl=bl))
            for _ in range(2):
                jax.block_until_ready(f(*x))
            emit(dict(op="profile", Hv=hv, B=b, N=n, spec=spec))


# ---------------------------------------------------------------------------------------- chunk


def fla_chunk(args_):
    """fla's ``chunk_gated_delta_rule`` on torch copies of the inputs, as a thunk."""
    import torch
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    tt = [torch.from_numpy(np.array(x.astype(F32))).cuda() for x in args_]
    tq, tk, tv = (x.to(torch.bfloat16) for x in tt[:3])
    tg, tb, ts0 = tt[3], tt[4], tt[5]
    return lambda: chunk_gated_delta_rule(
        tq, tk, tv, tg, tb, initial_state=ts0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )


def bench_chunk_shape(args, bw, blocks, fla_ok: bool, hv, b, t) -> dict:
    """One ``chunk`` row."""
    args_ = chunk_inputs(t + b, b, t, hv)
    byts = b * t * (2 * HK * K * 2 + hv * V * 2 * 2 + hv * 8) + 2 * b * hv * K * V * 4
    row = dict(op="chunk", Hv=hv, B=b, T=t, floor_us=1e6 * byts / bw)
    ox, sx = jax.jit(lambda *a: xla_chunk(*a, use_qk_l2norm=True, impl="xla"))(*args_)

    def pallas(*a, bl):
        return pk.chunk_gated_delta_rule(
            *a, use_qk_l2norm=True, blocks=bl, chunk_size=args.chunk_size
        )

    def check():
        op, sp = jax.jit(functools.partial(pallas, bl=blocks[0]))(*args_)
        return max(rel(op, ox), rel(sp, sx))

    attempt(row, "rel_err_vs_xla", check)
    for i, bl in enumerate(blocks):
        attempt(row, f"pallas{i}_us", call_us, functools.partial(pallas, bl=bl), [args_], args.reps)
    row["pallas_us"], row["best_variant"] = best_of(row, "pallas", len(blocks))
    if not args.no_xla:
        op = lambda *a: xla_chunk(*a, use_qk_l2norm=True, impl="xla")
        attempt(row, "xla_us", call_us, op, [args_], args.reps)
    if fla_ok:
        from triton.testing import do_bench

        call = fla_chunk(args_)

        def fla_err():
            of, sf = call()
            return max(rel(of.float().cpu().numpy(), ox), rel(sf.float().cpu().numpy(), sx))

        def fla_us():
            return 1e3 * do_bench(call, warmup=100, rep=500, return_mode="median")

        attempt(row, "fla_rel_err_vs_xla", fla_err)
        attempt(row, "fla_us", fla_us)
        if "fla_us" in row and row["pallas_us"] < 1e30:
            row["pallas_over_fla"] = row["pallas_us"] / row["fla_us"]
    return row


def bench_chunk(args, bw, mm, emit):
    blocks = parse_blocks(args.chunk_blocks, pk.ChunkBlocks)
    fla_ok = False
    if not args.no_fla:
        try:
            import fla.ops.gated_delta_rule  # noqa: F401
            import torch  # noqa: F401
            import triton.testing  # noqa: F401

            fla_ok = True
        except Exception as e:  # report and continue without the comparison
            print(f"# fla unavailable: {e!r}", file=sys.stderr)
    for t, b in args.chunk_shapes:
        emit(bench_chunk_shape(args, bw, blocks, fla_ok, args.chunk_hv, b, t))


# --------------------------------------------------------------------------------------- output


def print_row(row):
    print("  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))


def variant_table(title: str, specs: list[str], rows: list[dict], cols: list) -> None:
    """The variants' specs and a table of ``cols``: a key, a pattern with ``{}`` or a function
    of the variant index (one column per variant)."""
    print(f"\n## {title}\n")
    for i, spec in enumerate(specs):
        print(f"- variant {i}: `{spec or 'defaults'}`")
    print()
    keys = ["Hv", "B", "N"] if "N" in rows[0] else ["Hv", "B", "T"]
    for col in cols:
        if callable(col) or "{}" in col:
            name = col if callable(col) else col.format
            keys += [name(i) for i in range(len(specs))]
        else:
            keys.append(col)
    print(markdown_table(rows, keys))


def print_tables(args, rows: list[dict]) -> None:
    by_op = {op: [r for r in rows if r["op"] == op] for op in {r["op"] for r in rows}}
    if orows := by_op.get("overhead"):
        print("\n## per op and fixed per program: fit of program time over R (us)\n")
        cols = ["Hv", "B", "N", "name", ("slope_us", "per op"), ("intercept_us", "fixed")]
        print(markdown_table(orows, cols))
    if vr := by_op.get("tree_verify"):
        if args.breakdown:
            print("\n## tree_verify cut after each stage (us; variant 0)\n")
            stages = [f"stage_{st}_us" for st in verify_kernel.STAGES[1:]]
            print(markdown_table(vr, ["Hv", "B", "N", *stages, "pallas0_us"]))
        split_cols = ["pallas_split_us", "split_over_fused", "split_rel_err_vs_xla"]
        mgpu_cols = ["pallas_mgpu_us", "mgpu_over_fused", "mgpu_over_floor", "mgpu_rel_err_vs_xla"]
        print("\n## tree_verify (us per layer)\n")
        cols = ["Hv", "B", "N", "pallas_us", *(split_cols if args.verify_split else [])]
        cols += mgpu_cols if args.verify_mgpu else []
        cols += ["pallas_chain_us", "xla_us", "snapshot_us", "floor_us", "pallas_over_floor"]
        cols += ["snapshot_over_pallas", "rel_err_vs_xla", "best_variant"]
        print(markdown_table(vr, cols))
        if len(args.verify_blocks) > 1:
            cols = ["pallas{}_us", rel_err_key]
            variant_table("tree_verify variants (us; rel err vs XLA)", args.verify_blocks, vr, cols)
        if args.verify_split:
            cols = ["pallas_us", "pallas_split{}_us", "split_rel_err{}", "pallas_split_chain_us"]
            cols += ["split_over_fused", "split_over_floor", "floor_us"]
            variant_table(
                "two-kernel verify against the fused one (us)", args.verify_split, vr, cols
            )
        print("\n## speculative memory per draft node, one layer (bytes)\n")
        mem = {r["Hv"]: r for r in vr}
        print("| Hv | WY (U, k, G, parent) | snapshot (K x V state) | ratio |\n|---|---|---|---|")
        for hv, r in mem.items():
            w, s = r["wy_bytes_per_node"], r["snapshot_bytes_per_node"]
            print(f"| {hv} | {w} | {s} | {s / w:.0f}x |")
    if cr := by_op.get("tree_commit"):
        print("\n## tree_commit (us per layer)\n")
        cols = ["Hv", "B", "N", "D", "pallas_us", "xla_us", "floor_us", "pallas_over_floor"]
        print(markdown_table(cr, [*cols, "rel_err_vs_xla", "best_variant"]))
        if len(args.commit_blocks) > 1:
            cols = ["pallas{}_us", rel_err_key]
            variant_table("tree_commit variants (us; rel err vs XLA)", args.commit_blocks, cr, cols)
    if ar := by_op.get("arena"):
        print("\n## states in the arena vs dense (us per layer)\n")
        cols = ["Hv", "B", "N", "verify_dense_us", "verify_arena_us", "verify_arena_over_dense"]
        cols += ["commit_dense_us", "commit_arena_us", "commit_arena_over_dense"]
        print(markdown_table(ar, [*cols, "verify_rel_diff", "commit_rel_diff"]))
    if pr := by_op.get("chunk"):
        print("\n## chunked prefill (us per layer)\n")
        cols = ["Hv", "B", "T", "pallas_us", "fla_us", "xla_us", "floor_us", "pallas_over_fla"]
        print(markdown_table(pr, [*cols, "rel_err_vs_xla", "fla_rel_err_vs_xla", "best_variant"]))
        if len(args.chunk_blocks) > 1:
            variant_table("chunked prefill variants (us)", args.chunk_blocks, pr, ["pallas{}_us"])


# ----------------------------------------------------------------------------------------- main

BENCHES = dict(
    overhead=bench_overhead,
    profile=bench_profile,
    verify=bench_verify,
    commit=bench_commit,
    arena=bench_arena,
    chunk=bench_chunk,
)


def chunk_shapes(s: str) -> list[tuple[int, int]]:
    """``'4096x1;16384x2'`` -> ``[(T, B), ...]``."""
    return [tuple(ints(x.replace("x", ","))) for x in s.split(";") if x]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.kernels",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    a = p.add_argument
    a("--ops", default="verify,commit,chunk", help=f"comma list of {', '.join(OPS)}")
    a(
        "--configs",
        default="",
        help="'Hv:B:N' list, e.g. '32:16:64;64:1:64' (default: --hv x --batch x --nodes)",
    )
    a("--hv", type=ints, default=[32, 64], help="value heads (Hk = 16)")
    a("--batch", type=ints, default=[1, 16, 64])
    a("--nodes", type=ints, default=[8, 32, 64, 128])
    a("--reps", type=int, default=10, help="timed repetitions (median)")
    a(
        "--verify-blocks",
        action="append",
        default=[],
        help="VerifyBlocks fields, e.g. 'precision=bf16x3,num_warps=8'; repeatable (variants)",
    )
    a(
        "--verify-split",
        action="append",
        nargs="?",
        const="",
        default=[],
        help="also time the two-kernel verify; an optional SplitVerifyBlocks spec,\n"
        "e.g. 'precision=bf16x3,block_v=128,num_warps_b=8'; repeatable",
    )
    a(
        "--verify-mgpu",
        action="append",
        nargs="?",
        const="",
        default=[],
        help="also time the Mosaic GPU verify (pallas_kernels.verify.mgpu; a Hopper GPU, N <= 64,\n"
        "bf16); an optional MgpuVerifyBlocks spec, e.g. 'lhs_in_smem=false,acc_init=true';\n"
        "repeatable",
    )
    a("--chains", action="store_true", help="also time the best verify variant on chains (depth N)")
    a("--breakdown", action="store_true", help="also time the verify kernel cut after each stage")
    a(
        "--snapshot-max-gb",
        type=float,
        default=40.0,
        help="skip the snapshot kernel above this many GB of node states",
    )
    a("--no-snapshot", action="store_true")
    a("--no-xla", action="store_true")
    a(
        "--gpu-max-nodes",
        type=int,
        default=0,
        help="let the x3-mode verify kernel try N up to this many nodes on GPU (its limit: 64)",
    )
    a(
        "--commit-blocks",
        action="append",
        default=[],
        help="CommitBlocks fields; repeatable (variants)",
    )
    a(
        "--chunk-blocks",
        action="append",
        default=[],
        help="ChunkBlocks fields, e.g. 'h_bf16=true,store_t=true'; repeatable (variants)",
    )
    a(
        "--chunk-shapes",
        type=chunk_shapes,
        default=[(4096, 1), (4096, 8), (16384, 2)],
        help="'T x B' pairs, e.g. '4096x1;16384x2'",
    )
    a("--chunk-hv", type=int, default=32, help="value heads of the chunked prefill")
    a("--chunk-size", type=int, default=64)
    a("--no-fla", action="store_true")
    a("--rs", type=ints, default=[1, 4, 16], help="overhead: input sets per program, fitted over")
    a(
        "--overhead-ops",
        default="",
        help="overhead: comma list of op names (default all: pallas[SPEC]..., xla,\n"
        "pallas_copy, xla_copy, pallas_tiny, xla_tiny)",
    )
    a("--json", metavar="PATH", help="write meta, args and rows here (after every row)")
    a(
        "--dry-run",
        action="store_true",
        help="CPU check: kernels in interpret mode, tiny ceiling measurements",
    )
    a("--watchdog", type=float, default=0, help="dump the stacks every this many seconds")
    return p


def main(argv=None) -> list[dict]:
    args = parser().parse_args(argv)
    ops = args.ops.split(",")
    if unknown := set(ops) - set(OPS):
        raise SystemExit(f"--ops: unknown {sorted(unknown)}; choose from {OPS}")
    if args.configs:
        args.configs = [tuple(ints(c.replace(":", ","))) for c in args.configs.split(";") if c]
    else:
        args.configs = [(h, b, n) for h in args.hv for b in args.batch for n in args.nodes]
    if args.watchdog:
        import faulthandler

        faulthandler.dump_traceback_later(args.watchdog, repeat=True)
    if args.gpu_max_nodes:
        verify_kernel.GPU_MAX_NODES_X3 = args.gpu_max_nodes
    if args.dry_run:
        for name in ("tree_verify", "tree_commit", "snapshot_verify", "chunk_gated_delta_rule"):
            setattr(pk, name, functools.partial(getattr(pk, name), interpret=True))
        split.tree_verify_split = functools.partial(split.tree_verify_split, interpret=True)
        verify_mgpu.tree_verify_mgpu = functools.partial(
            verify_mgpu.tree_verify_mgpu, interpret=True
        )
    dev = jax.devices()[0]
    print(f"# device {dev.device_kind}; jax {jax.__version__}")
    bw = mm = None
    if set(ops) != {"profile"}:
        log("measuring bandwidth and matmul rate")
        bw = measure_bandwidth(args.reps, 1 << 20 if args.dry_run else 256 << 20)
        mm = measure_matmul(args.reps, 256 if args.dry_run else 8192)
        print(
            f"# HBM {bw / 1e12:.2f} TB/s (copy, read + write); bf16 matmul {mm / 1e12:.0f} TFLOP/s"
        )
    rows: list[dict] = []
    meta = dict(device=dev.device_kind, jax=jax.__version__, hbm_bytes_per_s=bw, bf16_flops=mm)

    def emit(row):
        rows.append(row)
        write_json(args.json, dict(meta=meta, args=vars(args), rows=rows))
        print_row(row)

    for name in OPS:
        if name in ops:
            try:
                BENCHES[name](args, bw, mm, emit)
            except Exception as e:  # report and go on with the next op
                print(f"# {name} failed: {type(e).__name__}: {e}", file=sys.stderr)
    print_tables(args, rows)
    return rows


if __name__ == "__main__":
    main()
