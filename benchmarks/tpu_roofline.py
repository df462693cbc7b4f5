"""TPU roofline of the Mosaic TPU kernels at Qwen3.5-35B-A3B / 397B-A17B dims, from each
kernel's own block schedule (no TPU needed).

    python -m benchmarks.tpu_roofline [--chips v5e,v5p,v6e] [--json PATH]

For each kernel call the module traces the entry point of ``pallas_kernels.tpu`` at the given
shapes, takes its ``pallas_call`` and reads off:

- **HBM bytes**: the grid in order, every block spec's index map evaluated at every grid point
  (scalar-prefetched operands at their real values); a block is moved when its index differs
  from the previous grid point's (Pallas pipelining skips unchanged blocks), inputs in, outputs
  out;
- **compute of one program**: the kernel body's jaxpr: each ``dot_general`` on the MXU, whose
  operands the kernel has already split into bf16 pieces (one pass per dot); element-wise ops
  and reductions on the VPU, ``exp`` / ``rsqrt`` on the EUP, loops times their trip counts (the
  verify's Newton-Schulz loop: the steps the tree's depth needs; the commit's path loop: the
  path length).

The chip model (public figures, Google Cloud TPU documentation): bf16 peak and HBM bandwidth
per chip, MXU width (128 on v5e / v5p, 256 on v6e), TensorCores per chip (v5p: 2, megacore),
clock (peak over ``4 MXUs x width^2 x 2`` per core). A dot of ``[m, k] x [k, n]`` costs ``2
max(m, width) ceil(k / width) width ceil(n / width) width`` flops at peak (a weight tile of
``width x width`` takes ``width`` cycles to load, so fewer than ``width`` streamed rows cost as
many); the VPU does 4 ``(8, 128)`` f32 vreg ops per cycle per core and the EUP one, arrays
counted in whole vregs. A program's time is ``MXU + VPU + EUP`` (no overlap assumed); the
kernel's predicted time is ``max(compute of all programs / cores, bytes / bandwidth)``
(pipelined DMAs); "overlapped" takes ``max(MXU, VPU + EUP, DMA)`` instead, the bound if the
bundles kept both units busy. A TPU run would fall between the two. The roofline of the op is ``max(op bytes / bandwidth, op flops / peak)``
with the op's bytes and matmul flops counted as the GPU benchmark counts them
(``benchmarks/kernels.py``). "vs snapshot": the roofline of the per-node snapshot verify (each
node reads its parent's f32 state and writes its own) over the predicted tree WY verify.

Trees: each node's parent drawn among the 6 previous nodes (as the GPU benchmark), bf16 q, k,
v, f32 g, beta, states, ``use_qk_l2norm``.

Attention (``paged_attention_arena`` for decode, ``tree_attention_arena`` for the tree verify)
at Qwen3.5-35B-A3B's full-attention dims (16 query heads on 2 KV heads of 256), a bf16 cache in
16-token pages (the engine's page size) and 4096 committed keys a row: the arena stays in HBM
outside the block specs, so the kernel's bytes add the pages its own DMAs move (every page of
K and V of the row, whole), and its page loop runs ``ceil(4096 / 16 / 8)`` steps of 8 pages.
The op's bytes are the pages' K and V, q and the output in bf16 (the tree adds the draft K/V
and the bool path mask); its flops ``q k^T`` and ``p v`` over each query's keys (a tree node:
the committed keys and its path).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as jax_core
from jax._src.pallas import core as pallas_core
from jax._src.state import discharge as state_discharge

from benchmarks.common import gdn_dims, load_config, write_json
from pallas_kernels import tpu

RESULTS = Path(__file__).resolve().parent / "results" / "tpu_roofline"
CONFIGS = ("qwen3_5_35b_a3b", "qwen3_5_397b_a17b")
VALU_SLOTS = 4
VREG = (8, 128)


@dataclasses.dataclass(frozen=True)
class Chip:
    """Public per-chip figures."""

    name: str
    bf16_flops: float
    hbm_bytes_per_s: float
    mxu: int
    cores: int

    @property
    def clock(self) -> float:
        return self.bf16_flops / (self.cores * 4 * self.mxu * self.mxu * 2)


CHIPS = {
    "v5e": Chip("v5e", 197e12, 819e9, 128, 1),
    "v5p": Chip("v5p", 459e12, 2765e9, 128, 2),
    "v6e": Chip("v6e", 918e12, 1640e9, 256, 1),
}


# ----------------------------------------------------------------------- the kernel's schedule


def _capture(fn, *args):
    """``(pallas_call equation, its concrete inputs)`` of every ``pallas_call`` that ``fn``
    runs on ``args``: the traced program is evaluated with each ``pallas_call`` replaced by
    zeros, so the scalar-prefetch operands get their real values."""
    closed = jax.make_jaxpr(fn)(*args)
    calls = []

    def run(jaxpr, consts, *vals):
        env = {}

        def read(v):
            return v.val if isinstance(v, jax_core.Literal) else env[v]

        for var, val in zip(jaxpr.constvars, consts, strict=True):
            env[var] = val
        for var, val in zip(jaxpr.invars, vals, strict=True):
            env[var] = val
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            name = eqn.primitive.name
            if name == "pallas_call":
                calls.append((eqn, ins))
                outs = [jnp.zeros(v.aval.shape, v.aval.dtype) for v in eqn.outvars]
            elif name in ("pjit", "jit"):
                sub = eqn.params["jaxpr"]
                outs = run(sub.jaxpr, sub.consts, *ins)
            else:
                outs = eqn.primitive.bind(*ins, **eqn.params)
                outs = outs if eqn.primitive.multiple_results else [outs]
            for var, val in zip(eqn.outvars, outs, strict=True):
                env[var] = val
        return [read(v) for v in jaxpr.outvars]

    run(closed.jaxpr, closed.consts, *args)
    return calls


def hbm_bytes(eqn, ins) -> int:
    """Bytes the pipelined blocks of one ``pallas_call`` move (module docstring)."""
    gm = eqn.params["grid_mapping"]
    grid = tuple(int(g) for g in gm.grid)
    points = np.stack(np.meshgrid(*[np.arange(g) for g in grid], indexing="ij"), -1)
    points = points.reshape(-1, len(grid)).astype(np.int32)
    prefetch = ins[: gm.num_index_operands]
    total = 0
    for bm in gm.block_mappings:
        if bm.block_aval.memory_space == pallas_core.MemorySpace.ANY:
            continue
        jaxpr = state_discharge.discharge_state(bm.index_map_jaxpr, strip_memory_space=True)
        fn = jax_core.jaxpr_as_fun(jaxpr)
        nblock = len(bm.block_shape)

        def index(*idx, fn=fn, nblock=nblock):
            return jnp.stack(fn(*idx, *prefetch)[:nblock])

        idx = np.asarray(jax.jit(jax.vmap(index))(*points.T))
        moved = 1 + int(np.any(idx[1:] != idx[:-1], axis=1).sum())
        shape = pallas_core._get_block_shape(bm.block_shape)
        total += moved * math.prod(shape) * jnp.dtype(bm.array_aval.dtype).itemsize
    return total


@dataclasses.dataclass
class Work:
    """Compute of one program: padded MXU flops per MXU width, VPU and EUP vreg ops."""

    mxu: dict = dataclasses.field(default_factory=dict)
    vpu: float = 0.0
    eup: float = 0.0
    dots: int = 0

    def add(self, other: Work, times: float) -> None:
        for w, f in other.mxu.items():
            self.mxu[w] = self.mxu.get(w, 0.0) + f * times
        self.vpu += other.vpu * times
        self.eup += other.eup * times
        self.dots += int(other.dots * times)


ELEMENTWISE = {
    "add", "sub", "mul", "div", "max", "min", "neg", "abs", "sign", "select_n", "and", "or",
    "not", "xor", "eq", "ne", "lt", "le", "gt", "ge", "convert_element_type", "integer_pow",
    "floor", "ceil", "rem", "shift_right_logical", "shift_left", "square", "clamp",
}  # fmt: skip
TRANSCENDENTAL = {"exp", "exp2", "log", "rsqrt", "sqrt", "tanh", "logistic", "log1p", "pow"}
REDUCTIONS = {"reduce_sum", "reduce_max", "reduce_min", "reduce_and", "reduce_or", "argmax"}


def _vregs(aval) -> float:
    shape = tuple(aval.shape) or (1,)
    shape = shape if len(shape) >= 2 else (1, *shape)
    sub = VREG[0] * max(1, 4 // jnp.dtype(aval.dtype).itemsize)
    return math.prod(shape[:-2]) * -(-shape[-2] // sub) * -(-shape[-1] // VREG[1])


def kernel_work(jaxpr, widths, trips: dict[str, int]) -> Work:
    """:class:`Work` of one program of a kernel body ``jaxpr``; ``trips['while']``: the trip
    count of its data-dependent loops."""
    w = Work()
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (lc, rc), _ = eqn.params["dimension_numbers"]
            la, ra = eqn.invars[0].aval, eqn.invars[1].aval
            k = math.prod(la.shape[d] for d in lc)
            m = math.prod(la.shape) // k
            n = math.prod(ra.shape) // k
            for width in widths:
                pad = lambda x, width=width: -(-x // width) * width
                w.mxu[width] = w.mxu.get(width, 0.0) + 2 * max(-(-m // 8) * 8, width) * pad(
                    k
                ) * pad(n)
            w.dots += 1
        elif name in ELEMENTWISE:
            w.vpu += _vregs(eqn.outvars[0].aval)
        elif name in TRANSCENDENTAL:
            w.eup += _vregs(eqn.outvars[0].aval)
        elif name in REDUCTIONS:
            w.vpu += _vregs(eqn.invars[0].aval)
        elif name == "while":
            w.add(kernel_work(eqn.params["body_jaxpr"].jaxpr, widths, trips), trips.get("while", 1))
        elif name == "scan":
            w.add(kernel_work(eqn.params["jaxpr"].jaxpr, widths, trips), eqn.params["length"])
        elif name == "cond":
            branches = [kernel_work(b.jaxpr, widths, trips) for b in eqn.params["branches"]]
            w.add(max(branches, key=lambda b: b.vpu + sum(b.mxu.values())), 1)
        else:
            for p in eqn.params.values():
                sub = getattr(p, "jaxpr", p)
                if isinstance(sub, jax_core.Jaxpr):
                    w.add(kernel_work(sub, widths, trips), 1)
    return w


@dataclasses.dataclass
class Schedule:
    programs: int
    bytes: int
    work: Work


def schedule(fn, args, trips) -> Schedule:
    """The summed schedule of every ``pallas_call`` in ``fn(*args)`` (one here)."""
    calls = _capture(fn, *args)
    widths = sorted({c.mxu for c in CHIPS.values()})
    total = Schedule(0, 0, Work())
    for eqn, ins in calls:
        grid = math.prod(int(g) for g in eqn.params["grid_mapping"].grid)
        total.programs += grid
        total.bytes += hbm_bytes(eqn, ins)
        total.work.add(kernel_work(eqn.params["jaxpr"], widths, trips), grid)
    return total


def predicted_us(s: Schedule, chip: Chip) -> dict:
    """Predicted time of a schedule on ``chip`` and its parts, us."""
    mxu = s.work.mxu.get(chip.mxu, 0.0) / chip.bf16_flops
    per_core = chip.clock * chip.cores
    vpu = s.work.vpu / (VALU_SLOTS * per_core)
    eup = s.work.eup / per_core
    dma = s.bytes / chip.hbm_bytes_per_s
    return dict(
        predicted_us=1e6 * max(mxu + vpu + eup, dma),
        overlapped_us=1e6 * max(mxu, vpu + eup, dma),
        mxu_us=1e6 * mxu,
        vpu_us=1e6 * (vpu + eup),
        dma_us=1e6 * dma,
    )


# ------------------------------------------------------------------------------ the op floors


def random_parents(b: int, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    par = np.empty((b, n), np.int32)
    for r in range(b):
        par[r, 0] = -1
        for i in range(1, n):
            par[r, i] = rng.integers(max(0, i - 6), i)
    return par


def depth(parents: np.ndarray) -> int:
    out = 0
    for par in parents:
        d = np.zeros(len(par), int)
        for i, p in enumerate(par):
            d[i] = d[p] + 1 if p >= 0 else 1
        out = max(out, int(d.max()))
    return out


def newton_trips(parents: np.ndarray) -> int:
    """Inverse steps the verify runs for these trees (``2^j < depth``, ``j >= 1``)."""
    d = depth(parents)
    return sum(1 for j in range(1, 8) if (1 << j) < d)


def loop_trips(steps: int) -> dict:
    """Trip count of the verify's doubling loop: all steps but the last (a Newton step)."""
    return {"while": max(steps - 1, 0)}


def verify_floor(d, b, n):
    byts = (
        b * d.hv * d.k * d.v * 4
        + 2 * b * n * d.hk * d.k * 2
        + b * n * d.hv * d.v * 2
        + 2 * b * n * d.hv * 4
        + b * n * 4
        + b * n * d.hv * d.v * (2 + 4)
        + b * n * d.hv * 4
    )
    flops = b * d.hv * 2 * (2 * n * n * d.k + 2 * n * d.k * d.v + n * n * d.v)
    return byts, flops


def snapshot_bytes(d, b, n) -> int:
    """The per-node snapshot verify's state traffic: each node reads its parent's state and
    writes its own, f32."""
    return 2 * b * n * d.hv * d.k * d.v * 4 + b * d.hv * d.k * d.v * 4


def _zeros(shape, dtype):
    return jnp.zeros(shape, dtype)


def verify_case(d, b, n, chip_rows):
    par = random_parents(b, n, seed=b * 1000 + n)
    args = (
        _zeros((b, n, d.hk, d.k), jnp.bfloat16),
        _zeros((b, n, d.hk, d.k), jnp.bfloat16),
        _zeros((b, n, d.hv, d.v), jnp.bfloat16),
        _zeros((b, n, d.hv), jnp.float32),
        _zeros((b, n, d.hv), jnp.float32),
        jnp.asarray(par),
        _zeros((b, d.hv, d.k, d.v), jnp.float32),
    )
    blocks = tpu.TpuVerifyBlocks(mxu_rows=chip_rows)
    fn = lambda *a: tpu.tree_verify(*a, use_qk_l2norm=True, blocks=blocks)
    return schedule(fn, args, loop_trips(newton_trips(par))), par


def commit_case(d, b, n):
    """The commit of a path as deep as the verify case's trees."""
    par = random_parents(b, n, seed=b * 1000 + n)
    plen = min(depth(par), n)
    path = np.tile(np.arange(plen, dtype=np.int32), (b, 1))
    args = (
        _zeros((b, d.hv, d.k, d.v), jnp.float32),
        _zeros((b, n, d.hk, d.k), jnp.bfloat16),
        _zeros((b, n, d.hv, d.v), jnp.float32),
        _zeros((b, n, d.hv), jnp.float32),
        jnp.asarray(path),
        jnp.full((b,), plen, jnp.int32),
    )
    fn = lambda *a: tpu.tree_commit(*a, use_qk_l2norm=True)
    s = schedule(fn, args, {"while": plen})
    byts = 2 * b * d.hv * d.k * d.v * 4 + b * plen * (d.hk * d.k * 2 + d.hv * d.v * 4 + d.hv * 4)
    return s, byts, plen


def chunk_case(d, b, t, c, chip_rows):
    args = (
        _zeros((b, t, d.hk, d.k), jnp.bfloat16),
        _zeros((b, t, d.hk, d.k), jnp.bfloat16),
        _zeros((b, t, d.hv, d.v), jnp.bfloat16),
        _zeros((b, t, d.hv), jnp.float32),
        _zeros((b, t, d.hv), jnp.float32),
        _zeros((b, d.hv, d.k, d.v), jnp.float32),
    )
    blocks = tpu.TpuChunkBlocks(tpu.TpuVerifyBlocks(mxu_rows=chip_rows))
    fn = lambda *a: tpu.chunk_gated_delta_rule(*a, use_qk_l2norm=True, chunk_size=c, blocks=blocks)
    s = schedule(fn, args, {})
    byts = b * t * (2 * d.hk * d.k * 2 + d.hv * d.v * 2 * 2 + 2 * d.hv * 4)
    byts += 2 * b * d.hv * d.k * d.v * 4
    flops = b * d.hv * 2 * (t // c) * (2 * c * c * d.k + 4 * c * d.k * d.v + 2 * c * c * d.v)
    return s, byts, flops


def decode_case(d, b):
    args = (
        _zeros((b, d.hk, d.k), jnp.bfloat16),
        _zeros((b, d.hk, d.k), jnp.bfloat16),
        _zeros((b, d.hv, d.v), jnp.bfloat16),
        _zeros((b, d.hv), jnp.float32),
        _zeros((b, d.hv), jnp.float32),
        _zeros((b, d.hv, d.k, d.v), jnp.float32),
    )
    fn = lambda *a: tpu.recurrent_step(*a, use_qk_l2norm=True)
    s = schedule(fn, args, {})
    byts = 2 * b * d.hv * d.k * d.v * 4 + b * (2 * d.hk * d.k * 2 + 2 * d.hv * d.v * 2 + 8 * d.hv)
    return s, byts


def attention_dims(name: str) -> tuple[int, int, int]:
    """``(query heads, KV heads, head dim)`` of a config's full-attention layers."""
    _, cfg = load_config(name)
    return cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]


def _arena_operands(b: int, pages: int):
    """A small arena, a table and each row's ``pages`` distinct handles: the kernels move the
    pages by their own DMAs, so neither the arena's contents nor the addresses enter the
    schedule (``_capture`` never runs the ``pallas_call``)."""
    handles = jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)
    return jnp.zeros((1, 1 << 16), jnp.uint32), jnp.zeros((b * pages, 2), jnp.int32), handles


def _page_dma(b: int, context: int, page: int, hkv: int) -> tuple[int, dict]:
    """The arena bytes the attention kernels' own DMAs move (the arena is left in HBM, outside
    the block specs): each row's ``ceil(context / page)`` pages of K and V, ``page * Hkv``
    128-word rows each; and the trip count of the page loop (steps of
    :func:`pallas_kernels.tpu.attention.pages_per_step` pages)."""
    pages = -(-context // page)
    steps = -(-pages // tpu.attention.pages_per_step(page, pages))
    return b * pages * 2 * page * hkv * 128 * 4, {"while": steps}


def paged_attention_case(name, b, context, page):
    """Decode (one query a row at position ``context - 1``) over ``context`` keys a row in
    bf16 pages; op bytes: the pages' K and V, q and the output; flops: ``q k^T`` and ``p v``."""
    hq, hkv, d = attention_dims(name)
    arena, table, handles = _arena_operands(b, -(-context // page))
    args = (
        _zeros((b, 1, hq, d), jnp.bfloat16),
        jnp.full((b,), context, jnp.int32),
        jnp.full((b, 1), context - 1, jnp.int32),
    )

    def fn(q, kv_len, q_pos):
        return tpu.paged_attention_arena(
            q, arena=arena, table=table, page_handles=handles, layer=0, kv_offset=0,
            page_size=page, kv_dtype=jnp.bfloat16, kv_len=kv_len, q_pos=q_pos, kv_heads=hkv,
            scale=d**-0.5,
        )  # fmt: skip

    dma, trips = _page_dma(b, context, page, hkv)
    s = schedule(fn, args, trips)
    s.bytes += dma
    byts = b * context * hkv * d * 2 * 2 + 2 * b * hq * d * 2
    return s, byts, 4 * b * hq * d * context


def tree_attention_case(name, b, n, context, page):
    """The tree verify's attention: ``N`` draft nodes a row over ``context`` committed keys in
    bf16 pages and the draft K/V on each node's path (trees as the verify's); op bytes: the
    pages' K and V, q, the draft K and V, the path mask and the output; flops: each node's
    ``q k^T`` and ``p v`` over its ``context + depth`` keys."""
    hq, hkv, d = attention_dims(name)
    par = random_parents(b, n, seed=b * 1000 + n)
    mask = np.zeros((b, n, n), bool)
    for r in range(b):
        for i in range(n):
            j = i
            while j >= 0:
                mask[r, i, j] = True
                j = par[r, j]
    arena, table, handles = _arena_operands(b, -(-context // page))
    args = (
        _zeros((b, n, hq, d), jnp.bfloat16),
        jnp.full((b,), context, jnp.int32),
        _zeros((b, n, hkv, d), jnp.bfloat16),
        _zeros((b, n, hkv, d), jnp.bfloat16),
        jnp.asarray(mask),
    )

    def fn(q, kv_len, dk, dv, dmask):
        return tpu.tree_attention_arena(
            q, arena, table, handles, kv_len, dk, dv, dmask, layer=0, kv_offset=0,
            page_size=page, kv_dtype=jnp.bfloat16, scale=d**-0.5,
        )  # fmt: skip

    dma, trips = _page_dma(b, context, page, hkv)
    s = schedule(fn, args, trips)
    s.bytes += dma
    byts = b * context * hkv * d * 2 * 2 + 2 * b * n * (hq + hkv) * d * 2 + b * n * n
    flops = 4 * hq * d * int(b * n * context + mask.sum())
    return s, byts, flops


# ----------------------------------------------------------------------------------- the table

VERIFY_CASES = ((1, 64), (16, 8), (16, 32), (16, 64), (16, 128), (64, 64))
COMMIT_CASES = ((16, 64), (64, 64))
CHUNK_CASES = ((1, 4096, 64), (1, 4096, 128), (8, 4096, 64))
DECODE_CASES = (1, 16, 64)
ATTENTION_CONFIG = "qwen3_5_35b_a3b"
PAGE, CONTEXT = 16, 4096  # the engine's page size; committed keys a row
PAGED_ATTENTION_CASES = (1, 16, 64)
TREE_ATTENTION_CASES = ((16, 64),)


def _row(chip: Chip, op: str, config: str, shape: str, s: Schedule, byts: int, flops: int):
    floor = max(byts / chip.hbm_bytes_per_s, flops / chip.bf16_flops)
    p = predicted_us(s, chip)
    return dict(
        chip=chip.name,
        op=op,
        config=config,
        shape=shape,
        kernel_bytes=s.bytes,
        op_bytes=byts,
        op_flops=flops,
        roofline_us=1e6 * floor,
        **p,
        over_roofline=p["predicted_us"] / (1e6 * floor),
        overlapped_over_roofline=p["overlapped_us"] / (1e6 * floor),
    )


def _once(cache: dict, fn, *args):
    """``fn(*args)``, computed once per ``(fn, args)``."""
    key = (fn.__name__, *args[1:])
    if key not in cache:
        cache[key] = fn(*args)
    return cache[key]


def rows(chips: list[Chip]) -> list[dict]:
    """Every case on every chip; schedules are shared by chips with the same MXU width."""
    out = []
    for name in CONFIGS:
        d = gdn_dims(name)
        cache: dict = {}
        for chip in chips:
            w = chip.mxu
            for b, n in VERIFY_CASES:
                s, par = _once(cache, verify_case, d, b, n, w)
                byts, flops = verify_floor(d, b, n)
                row = _row(chip, "tree_verify", name, f"B {b}, N {n}", s, byts, flops)
                row["inverse_steps"] = newton_trips(par)
                snap = snapshot_bytes(d, b, n) / chip.hbm_bytes_per_s
                row["snapshot_roofline_us"] = 1e6 * snap
                row["wy_vs_snapshot"] = 1e6 * snap / row["predicted_us"]
                out.append(row)
                if (b, n) in COMMIT_CASES:
                    s, byts, plen = _once(cache, commit_case, d, b, n)
                    shape = f"B {b}, N {n}, path {plen}"
                    out.append(_row(chip, "tree_commit", name, shape, s, byts, 0))
            for b, t, c in CHUNK_CASES:
                s, byts, flops = _once(cache, chunk_case, d, b, t, c, w)
                out.append(_row(chip, "chunk", name, f"B {b}, T {t}, C {c}", s, byts, flops))
            for b in DECODE_CASES:
                s, byts = _once(cache, decode_case, d, b)
                out.append(_row(chip, "decode", name, f"B {b}", s, byts, 0))
            if name != ATTENTION_CONFIG:
                continue
            for b in PAGED_ATTENTION_CASES:
                s, byts, flops = _once(cache, paged_attention_case, name, b, CONTEXT, PAGE)
                shape = f"B {b}, L {CONTEXT}"
                out.append(_row(chip, "paged_attention", name, shape, s, byts, flops))
            for b, n in TREE_ATTENTION_CASES:
                s, byts, flops = _once(cache, tree_attention_case, name, b, n, CONTEXT, PAGE)
                shape = f"B {b}, N {n}, L {CONTEXT}"
                out.append(_row(chip, "tree_attention", name, shape, s, byts, flops))
    return out


def print_table(rs: list[dict]) -> None:
    print(
        "| chip | op | config | shape | op MB | kernel MB | roofline us | MXU / VPU / DMA us "
        "| predicted us | / roofline | overlapped / roofline | WY vs snapshot |"
    )
    print("| --- " * 12 + "|")
    for r in rs:
        snap = f"{r['wy_vs_snapshot']:.1f}x" if "wy_vs_snapshot" in r else "-"
        cfg = r["config"].replace("qwen3_5_", "").replace("_a3b", "").replace("_a17b", "")
        print(
            f"| {r['chip']} | {r['op']} | {cfg} | {r['shape']} | {r['op_bytes'] / 1e6:.1f} | "
            f"{r['kernel_bytes'] / 1e6:.1f} | {r['roofline_us']:.1f} | "
            f"{r['mxu_us']:.0f} / {r['vpu_us']:.0f} / {r['dma_us']:.0f} | "
            f"{r['predicted_us']:.1f} | {r['over_roofline']:.2f} | "
            f"{r['overlapped_over_roofline']:.2f} | {snap} |"
        )


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--chips", default="v5e,v5p,v6e")
    ap.add_argument("--json", default=str(RESULTS / "roofline.json"))
    args = ap.parse_args(argv)
    chips = [CHIPS[c] for c in args.chips.split(",")]
    rs = rows(chips)
    print_table(rs)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        write_json(args.json, dict(chips=[dataclasses.asdict(c) for c in chips], rows=rs))
    return rs


if __name__ == "__main__":
    main()
