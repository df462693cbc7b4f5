"""Per-kernel times of the three-kernel chunked prefill (``pallas_kernels.chunk``) on one GPU.

Times kernel 1 (``intra``: in-chunk solve), kernel 2 (``state``: sequential pass over chunks) and
kernel 3 (``out``) separately, each as its own jitted ``pallas_call`` fed with the previous
stages' outputs (computed once per input set), for every ``--shapes`` x ``--blocks`` pair, and
the whole call (``full``; also checks that the three stages run alone give the whole call's
``o`` and final state bit for bit). Inputs as ``benchmarks.kernels``' chunk benchmark: bf16
q/k/v ~ N(0, 1), ``g = -U(0.01, 0.2)``, ``beta = U(0.05, 1)``, ``s0 = 0.1 N(0, 1)`` f32,
``use_qk_l2norm=True``, Hk 16, K = V = 128, chunk 64. Timing: back-to-back asynchronous calls
rotating over ``--sets`` input sets (past the L2), one block at the end, median over ``--reps``.

With ``fuse_out=true`` there are two kernels (kernel 2 writes the outputs). Counts per kernel
(``counts``; every figure for the kernel as written, not for the algorithm's minimum):

* ``bytes``: HBM bytes if every distinct tile is read from HBM once (tiles shared by programs,
  e.g. a key head's ``k`` read by its value heads, or ``W`` by the ``V / block_v_state`` programs
  of a head, counted once) and every output written once. ``l2_bytes``: what the programs
  request (shared tiles counted per program), in the JSON only.
* ``flops``: tensor-core flops as issued, in bf16-pass equivalents: ``2 m n k`` per dot times
  its passes (``ff`` f32 x f32 dots: 1 for ``bf16``, 3 for ``bf16x3``, 6 for ``tf32x3`` /
  ``highest`` (3 tf32 passes at half the bf16 rate); raw-bf16 x f32 dots: the f32 operand's
  pieces (1/2/3); raw x raw: 1), including the output kernel's ``Q K^T`` recomputed by each of
  its ``V / block_v_out`` programs. ``flops_1pass``: the same dots at one pass (JSON only).
  Element-wise work (splits, exp, masks) is not counted.
* ``floor_us = max(bytes / --bw, flops / --mm)`` (defaults 4.1e12 B/s, 6.9e14 flop/s, the
  H200's measured copy bandwidth and bf16 matmul rate); ``x_floor = us / floor_us``.

    python -m benchmarks.chunk_breakdown --shapes "4096x8;16384x1" \\
        --blocks "h_bf16=true" --blocks "h_bf16=true,store_t=true" --json breakdown.json
    python -m benchmarks.chunk_breakdown --dry-run   # CPU, interpret mode, < 1 min
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import functools  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.common import log, markdown_table, parse_blocks, write_json  # noqa: E402
from benchmarks.kernels import chunk_inputs  # noqa: E402
from benchmarks.timing import timed  # noqa: E402
from pallas_kernels.chunk import kernel as chunk_kernel  # noqa: E402

KERNELS = ("intra", "state", "out")


# ---------------------------------------------------------------------------------------------
# Counts


def counts(cfg, b: int, t: int, hk: int, hv: int, dk: int, dv: int, n_slots: int) -> dict:
    """Per kernel: ``bytes`` (unique HBM), ``l2_bytes`` (requested), ``flops`` (issued, bf16-pass
    equivalents), ``flops_1pass`` and ``grid`` (programs); bf16 q/k/v/o, f32 g/beta/s0. With
    ``fuse_out`` there is no ``out`` kernel."""
    bl, d, c = cfg.blocks, cfg.dots, cfg.chunk
    st, fuse = bl.store_t, bl.fuse_out
    ff = {"bf16": 1, "bf16x3": 3, "tf32x3": 6, "highest": 6}[d.precision]
    split = chunk_kernel._PIECES[d.precision] if d.exact else ff
    rr = 1 if d.exact else ff
    wv = split if cfg.exact_v else ff
    ns, nt, n_seq = n_slots, n_slots * c, b
    hb = 2 if bl.h_bf16 else 4
    ub = 2 if bl.u_bf16 else 4
    nvs, nvo = dv // cfg.bvs, dv // cfg.bvo
    sub, nb = cfg.sub, c // cfg.sub
    pairs = nb * (nb + 1) // 2
    n_it = max(sub - 1, 1).bit_length() - 1
    n_off = sum((nb - e) * (e + 1) for e in range(1, nb))

    def flops(w_rr, w_ff, w_split, w_v):
        """Per (chunk slot, value head), summed over the value-column programs."""
        intra = pairs * 2 * sub * sub * dk * w_rr + (nb * n_it * 2 + n_off) * 2 * sub**3 * w_ff
        if not st:
            intra += pairs * 2 * sub * sub * (dk * w_split + dv * w_v)
        if st:
            state = 2 * c * dk * dv * w_split + 2 * c * c * dv * w_ff  # K S, Tb R
        else:
            state = 2 * c * dk * dv * w_ff  # W S
        state += 2 * dk * c * dv * w_split  # K^T X
        if fuse:  # Q S, Q K^T (every value-column program), att U
            state += 2 * c * dk * dv * w_split + 2 * c * c * dk * w_rr * nvs + 2 * c * c * dv * w_ff
        out = 2 * c * c * dk * w_rr * nvo + 2 * c * dk * dv * (w_rr if bl.h_bf16 else w_split)
        out += 2 * c * c * dv * (w_split if bl.u_bf16 else w_ff)
        return dict(intra=ns * hv * intra, state=ns * hv * state, out=ns * hv * out)

    issued, one = flops(rr, ff, split, wv), flops(1, 1, 1, 1)
    vec = ns * hv * c * 4  # one f32 per (slot, head, row): gc, rk
    cc = ns * hv * c * c * 4  # one f32 C x C matrix per (slot, head): Tb
    tok_u = nt * hk * dk * 2  # q or k (bf16), unique per key head
    tok_r = nt * hv * dk * 2  # ... as requested by every value head's program
    v_all, o_all = nt * hv * dv * 2, nt * hv * dv * 2
    gb = nt * hv * 8  # g, beta f32
    sts = n_seq * hv * dk * dv * 4  # s0 or the final states
    # kernel 1
    i_in_u, i_in_r = tok_u + gb, tok_r + gb
    i_out = 2 * vec + (cc if st else ns * hv * c * (dk + dv) * 4)
    if not st:
        i_in_u, i_in_r = i_in_u + v_all, i_in_r + v_all
    # kernel 2: what every value-column program reads in full (shared) vs its own columns
    shared_u = tok_u + 2 * vec + (cc if st else ns * hv * c * dk * 4)  # k, gc, rk, Tb or W
    shared_r = tok_r + 2 * vec + (cc if st else ns * hv * c * dk * 4)
    own = sts + (v_all if st else ns * hv * c * dv * 4)  # s0, v or Uv
    if fuse:
        shared_u, shared_r = shared_u + tok_u, shared_r + tok_r  # q
        s_out = o_all + sts
    else:
        s_out = ns * hv * c * dv * ub + ns * hv * dk * dv * hb + sts
    # kernel 3
    o_in_u = 2 * tok_u + 2 * vec + ns * hv * c * dv * ub + ns * hv * dk * dv * hb
    o_in_r = (2 * tok_r + 2 * vec) * nvo + ns * hv * c * dv * ub + ns * hv * dk * dv * hb
    res = dict(
        intra=dict(bytes=i_in_u + i_out, l2_bytes=i_in_r + i_out, grid=ns * hv),
        state=dict(bytes=shared_u + own + s_out, l2_bytes=shared_r * nvs + own + s_out),
        out=dict(bytes=o_in_u + o_all, l2_bytes=o_in_r + o_all, grid=ns * hv * nvo),
    )
    res["state"]["grid"] = n_seq * hv * nvs
    for name, r in res.items():
        r.update(flops=issued[name], flops_1pass=one[name])
    if fuse:
        del res["out"]
    return res


# ---------------------------------------------------------------------------------------------
# Measurement


def stage_fns(cfg, out_dtype):
    """The kernels as separately jitted functions of the previous stages' outputs (no third with
    ``fuse_out``)."""
    f1 = jax.jit(functools.partial(chunk_kernel.intra_call, cfg))
    f2 = jax.jit(functools.partial(chunk_kernel.state_call, cfg, out_dtype=out_dtype))
    if cfg.blocks.fuse_out:
        return f1, f2
    f3 = jax.jit(functools.partial(chunk_kernel.out_call, cfg, out_dtype=out_dtype))
    return f1, f2, f3


def measure(args, b: int, t: int, spec: str, bl, full: bool) -> list[dict]:
    """Rows (one per kernel, ``sum`` and ``full``) for one shape and one blocks spec."""
    interp = args.dry_run
    dims = (args.hk, args.hv, args.dk, args.dv)
    sets = [
        chunk_inputs(1000 * i + t + b, b, t, args.hv, args.hk, args.dk, args.dv)
        for i in range(args.sets)
    ]
    ins1, ins2, ins3, outs = [], [], [], []
    cfg = fns = None
    for q, k, v, g, beta, s0 in sets:
        cfg, plan, flat = chunk_kernel.prepare(
            q,
            k,
            v,
            g,
            beta,
            s0,
            scale=None,
            use_qk_l2norm=True,
            chunk_size=args.chunk,
            cu_seqlens=None,
            blocks=bl,
            interpret=interp,
        )
        start, length, seq_first, seq_chunks = plan
        qf, kf, vf, gf, bf, s0f = flat
        if fns is None:
            fns = stage_fns(cfg, v.dtype)
        ins1.append((start, length, kf, vf, gf, bf))
        inter = fns[0](*ins1[-1])
        ins2.append((seq_first, seq_chunks, start, length, qf, kf, vf, inter, s0f))
        if bl.fuse_out:
            o, final = fns[1](*ins2[-1])
        else:
            u, h, final = fns[1](*ins2[-1])
            ins3.append((start, length, qf, kf, *inter[-2:], u, h))
            o = fns[2](*ins3[-1])
            del u, h
        outs.append((o[: b * t].reshape(b, t, args.hv, args.dv), final))
        del inter
    n_slots = int(ins1[0][0].shape[0])
    cnt = counts(cfg, b, t, *dims, n_slots)
    base = dict(B=b, T=t, Hv=args.hv, spec=spec or "default")
    rows = []
    for name, fn, ins in zip(KERNELS, fns, (ins1, ins2, ins3)[: len(fns)], strict=False):
        row = dict(base, kernel=name, **cnt[name])
        try:
            row["us"] = 1e6 * timed(fn, ins, args.reps, args.iters)
        except Exception as e:  # keep the other kernels' figures
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            log(f"{spec} {name} failed: {row['error']}")
        rows.append(row)
        log(f"B{b} T{t} {spec or 'default'} {name}: {row.get('us', float('nan')):.1f} us")
    total = dict(base, kernel="sum")
    for key in ("bytes", "l2_bytes", "flops", "flops_1pass"):
        total[key] = sum(r[key] for r in rows)
    if all("us" in r for r in rows):
        total["us"] = sum(r["us"] for r in rows)
    rows.append(total)
    del ins1, ins2, ins3
    if full:
        row = dict(base, kernel="full")
        fcall = jax.jit(
            lambda *a: chunk_kernel.chunk_gated_delta_rule(
                *a, use_qk_l2norm=True, chunk_size=args.chunk, blocks=bl, interpret=interp
            )
        )
        try:
            same = True
            for s, (o, final) in zip(sets, outs, strict=True):
                of, sf = fcall(*s)
                same &= bool(jnp.array_equal(of, o)) and bool(jnp.array_equal(sf, final))
            row["stages_equal_full"] = same
            row["us"] = 1e6 * timed(fcall, sets, args.reps, args.iters)
            log(f"B{b} T{t} {spec or 'default'} full: {row['us']:.1f} us, stages equal: {same}")
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            log(f"{spec} full failed: {row['error']}")
        # the op's own floor: q, k, v, g, beta, s0 read, o and the final state written
        row["bytes"] = b * t * (2 * args.hk * args.dk * 2 + args.hv * (2 * args.dv * 2 + 8))
        row["bytes"] += 2 * b * args.hv * args.dk * args.dv * 4
        row["flops"] = 0
        rows.append(row)
    for r in rows:
        mem, mma = r["bytes"] / args.bw, r.get("flops", 0) / args.mm
        r["mem_floor_us"], r["mma_floor_us"] = 1e6 * mem, 1e6 * mma
        r["floor_us"] = 1e6 * max(mem, mma)
        if "us" in r:
            r["x_floor"] = r["us"] / r["floor_us"]
    return rows


TABLE = [
    *("B", "T", "spec", "kernel", "grid", "us", "MB", "GFLOP"),
    ("mem_floor_us", "mem floor us"),
    ("mma_floor_us", "mma floor us"),
    ("x_floor", "us / floor"),
]


def table(rows: list[dict]) -> str:
    """The rows as a Markdown table (bytes in MB, flops in GFLOP; a failed kernel's time
    'failed')."""
    shown = []
    for r in rows:
        cell = dict(r, spec=f"`{r.get('spec', '')}`")
        for key, unit, scale in (("bytes", "MB", 1e-6), ("flops", "GFLOP", 1e-9)):
            if key in r:
                cell[unit] = r[key] * scale
        if "error" in r and "us" not in r:
            cell["us"] = "failed"
        shown.append(cell)
    return markdown_table(shown, TABLE, digits=4)


def shapes(s: str) -> list[tuple[int, int]]:
    """``'TxB;TxB'`` -> ``[(B, T), ...]``."""
    out = []
    for item in filter(None, s.split(";")):
        t, b = (int(x) for x in item.lower().split("x"))
        out.append((b, t))
    return out


SUM_NOTE = (
    "# sum: the kernels' times and counts added; full: the whole call (XLA prologue and "
    "reshapes included), its floor the op's own (q, k, v, g, beta, s0 read; o and the final "
    "state written)"
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.chunk_breakdown",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    a = p.add_argument
    a("--shapes", default="4096x8;16384x1", help="'T x B' pairs, e.g. '4096x8;16384x1'")
    a(
        "--blocks",
        action="append",
        default=[],
        help="ChunkBlocks fields, e.g. 'h_bf16=true,store_t=true' ('' = defaults); repeatable",
    )
    a("--hv", type=int, default=32, help="value heads")
    a("--hk", type=int, default=16, help="key heads")
    a("--dk", type=int, default=128, help="K")
    a("--dv", type=int, default=128, help="V")
    a("--chunk", type=int, default=64)
    a("--reps", type=int, default=5, help="timed repetitions (median)")
    a("--iters", type=int, default=20, help="back-to-back calls per repetition")
    a("--sets", type=int, default=2, help="input sets rotated through")
    a(
        "--full",
        choices=("all", "first", "none"),
        default="first",
        help="also time the whole call and check the stages against it: for every spec, the\n"
        "first spec of each shape, or never (each costs one more compile of the kernels)",
    )
    a("--bw", type=float, default=4.1e12, help="HBM bytes/s of the floor")
    a("--mm", type=float, default=6.9e14, help="bf16 matmul flop/s of the floor")
    a(
        "--budget-s",
        type=float,
        default=0,
        help="start no new (shape, spec) after this many seconds (0: no limit)",
    )
    a("--json", default="", help="write meta, args and rows here (after each spec)")
    a(
        "--dry-run",
        action="store_true",
        help="CPU check: interpret mode, T 128, B 1, Hv 16 (unless --shapes/--hv given),\n"
        "1 set, 1 rep, 1 iter",
    )
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    if args.dry_run:
        given = set(argv if argv is not None else sys.argv[1:])
        if "--shapes" not in given:
            args.shapes = "128x1"
        if "--hv" not in given:
            args.hv = 16
        args.reps, args.iters, args.sets = 1, 1, 1
    specs = args.blocks or ["h_bf16=true"]
    blocks = parse_blocks(specs, chunk_kernel.ChunkBlocks)
    dev = jax.devices()[0]
    floor = f"{args.bw / 1e12:.2f} TB/s, {args.mm / 1e12:.0f} TFLOP/s (bf16)"
    print(f"# device {dev.device_kind}; jax {jax.__version__}; floor: {floor}", flush=True)
    t_start = time.perf_counter()
    rows: list[dict] = []
    skipped = []
    for b, t in shapes(args.shapes):
        for i, (spec, bl) in enumerate(zip(specs, blocks, strict=True)):
            if args.budget_s and time.perf_counter() - t_start > args.budget_s:
                skipped.append(f"{t}x{b} {spec}")
                log(f"budget spent: skipping T{t} B{b} `{spec}`")
                continue
            full = args.full == "all" or (args.full == "first" and i == 0)
            try:
                new = measure(args, b, t, spec, bl, full)
            except Exception as e:  # report and go on with the next spec
                log(f"T{t} B{b} `{spec}` failed: {type(e).__name__}: {str(e)[:500]}")
                new = [dict(B=b, T=t, spec=spec, kernel="all", error=f"{type(e).__name__}: {e}")]
            rows += new
            for r in new:
                if "us" in r:
                    name = f"B{b} T{t} {spec or 'default'} {r['kernel']}"
                    floor = f"floor {r['floor_us']:.1f}, x{r['x_floor']:.2f}"
                    print(f"{name}: {r['us']:.1f} us ({floor})", flush=True)
            elapsed = time.perf_counter() - t_start
            meta = dict(
                device=dev.device_kind, jax=jax.__version__, skipped=skipped, elapsed_s=elapsed
            )
            write_json(args.json, dict(meta=meta, args=vars(args), rows=rows))
    print("\n## chunked prefill, per kernel\n")
    print(table([r for r in rows if "kernel" in r and r["kernel"] != "all"]))
    print(SUM_NOTE)
    checks = [r for r in rows if "stages_equal_full" in r]
    for r in checks:
        same = r["stages_equal_full"]
        print(f"# B{r['B']} T{r['T']} `{r['spec']}`: stages alone equal the whole call: {same}")
    if skipped:
        print(f"# skipped (budget): {'; '.join(skipped)}")
    print(f"# elapsed {time.perf_counter() - t_start:.0f} s")
    if any(r.get("stages_equal_full") is False for r in checks):
        sys.exit(1)


if __name__ == "__main__":
    main()
