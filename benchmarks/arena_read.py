"""What reading GDN states through the memory manager's arena costs a decode step.

A GDN decode-like step over every GDN layer of a model (default: Qwen3.5-35B-A3B, 30 GDN
layers of Hv 32 x K 128 x V 128 f32 recurrent state plus a bf16 conv state of 3 x 8192 per
slot): per layer, read the batch's recurrent and conv states, one recurrent gated-delta-rule
token (``gdn_jax.recurrent_gated_delta_rule``, q/k l2norm) and the conv shift, and write both
states back; the storage is donated so every write is in place. Three storages:

- ``native``: dense per-layer arrays ``[L, B, Hv, K, V]`` f32 and ``[L, B, W-1, C]`` bf16, rows
  contiguous (no indirection: the floor of any paged layout);
- ``pooled``: the same arrays with ``2B`` slots, rows picked by slot id (gather and scatter
  by slot: per-layer pools indexed by a slot table);
- ``arena``: the engine's arena path: a real ``MemoryManager`` arena (``uint32``) with each
  row's ``state`` handle translated through the device table, every layer's state read as a
  word window and bitcast (``serving.arena_cache.ArenaCache.gdn_state`` /
  ``with_gdn_state``, the code the engine runs);
- ``arena_kernel``: the same arena, the recurrent state read and written in place by the
  Pallas decode kernel (``ArenaCache.gdn_step_rule``, i.e. ``LLM(kernels="pallas")``; interpret
  mode off GPU), the conv state still through the word windows.

Reported per batch size: median seconds of the jitted step over ``--reps`` calls (after a
warm-up), the bytes the step must move (read + write of every state), the rate achieved, the
floor (bytes / measured copy bandwidth) and each storage's time over ``native``.

``--step prefill``: one engine-sized prefill chunk of ``T`` tokens (``--chunk``, default 16,64)
per row instead of one decode token, over the same layers and batch sizes. Per layer the
recurrent state is read, the chunk's ``T`` tokens run through it (q/k l2norm) and the final
state written back; the conv state is read and replaced by the chunk's last ``W-1`` pre-conv
inputs (as the engine's prefill leaves it). Storages:

- ``native``: dense per-layer arrays, ``gdn_jax.chunk_gated_delta_rule`` (the no-arena floor);
- ``arena``: the engine's XLA path: each row's state gathered through the handle table as a
  word window (``ArenaCache.gdn_state``), the chunked rule the model's GDN layer calls without
  a rule (``chunk_gated_delta_rule``, ``impl`` from ``--prefill-impl``, default ``"auto"`` as
  the engine: the Pallas chunked kernel on GPU, XLA elsewhere) and the final state scattered
  back (``with_gdn_state``);
- ``arena_kernel``: the Pallas arena prefill kernel reading and writing the state in place
  (``ArenaCache.gdn_prefill_rule``, :func:`pallas_kernels.decode.arena.recurrent_prefill`;
  interpret mode off GPU).

Every step returns each layer's output ``o [B, T, Hv, V]``. Reported per ``(B, T)``: median
seconds, the bytes the step must move (state and conv read + write, q/k/v/g/beta and the
conv tail read, ``o`` written), the floor over the copy bandwidth (``--bandwidth`` GB/s, or
measured), ``kernel / arena`` and the kernel's final states and outputs against ``arena``'s
(max abs diff; the states must agree to 1e-3 of their largest magnitude, the bf16 outputs to
1e-2; checked after the JSON is written).

    python -m benchmarks.arena_read --json results.json
    python -m benchmarks.arena_read --num-layers 4 --batch 1,2 --reps 5   # CPU smoke
    python -m benchmarks.arena_read --step prefill --batch 1,16,64 --chunk 16,64 --reps 5
    python -m benchmarks.arena_read --step prefill --smoke --json p.json  # CPU smoke (<1 min)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gdn_jax import chunk_gated_delta_rule, recurrent_gated_delta_rule  # noqa: E402
from gdn_jax.dispatch import resolve_impl  # noqa: E402
from serving.arena_cache import ArenaCache  # noqa: E402
from serving.arena_spec import ArenaSpec  # noqa: E402
from serving.kernels import XLA_KERNELS, ArenaKernels  # noqa: E402
from serving.memory import MemoryManager, OutOfMemoryError, layout_for  # noqa: E402

CONFIG = Path(__file__).parent / "configs" / "qwen3_5_35b_a3b.json"


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def median_time(step, storage, inputs, reps: int) -> float:
    """Median seconds of ``storage, out = step(storage, *inputs)`` (storage donated)."""
    storage, out = step(storage, *inputs)  # compile + warm up
    jax.block_until_ready((storage, out))
    storage, out = step(storage, *inputs)
    jax.block_until_ready((storage, out))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        storage, out = step(storage, *inputs)
        jax.block_until_ready((storage, out))
        ts.append(time.perf_counter() - t0)
    jax.block_until_ready(storage)
    del storage
    return statistics.median(ts)


def copy_bandwidth(nbytes: int, reps: int) -> float:
    """Bytes per second of a jitted ``x + 1`` over ``nbytes`` of f32 (read + write)."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda x: x + 1, donate_argnums=0)
    x = f(x).block_until_ready()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        x = f(x).block_until_ready()
        ts.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(ts)


def gdn_token(ssm, conv, q, k, v, g, beta, x):
    """One decode token of one GDN layer: ``(output sum, new ssm, new conv)``."""
    o, new = recurrent_gated_delta_rule(
        q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], ssm, use_qk_l2norm=True
    )
    new_conv = jnp.concatenate([conv[:, 1:], x[:, None].astype(conv.dtype)], axis=1)
    acc = jnp.sum(o, dtype=jnp.float32) + jnp.sum(new_conv[:, -1], dtype=jnp.float32) * 1e-3
    return acc, new, new_conv


def make_inputs(key, layers, b, spec: ArenaSpec, hk: int):
    hv, kd, vd = spec.state_shape
    c = spec.conv_shape[1]
    ks = jax.random.split(key, 6)
    q = jax.random.normal(ks[0], (layers, b, hk, kd), jnp.bfloat16)
    k = jax.random.normal(ks[1], (layers, b, hk, kd), jnp.bfloat16)
    v = jax.random.normal(ks[2], (layers, b, hv, vd), jnp.bfloat16)
    g = -jax.random.uniform(ks[3], (layers, b, hv), jnp.float32, 0.01, 0.5)
    beta = jax.random.uniform(ks[4], (layers, b, hv), jnp.float32, 0.1, 0.9)
    x = jax.random.normal(ks[5], (layers, b, c), jnp.bfloat16)
    return q, k, v, g, beta, x


def arena_cache(buf, table, handles, spec: ArenaSpec, kernels=XLA_KERNELS) -> ArenaCache:
    """The rows' view of the arena ``buf`` (one empty page table row each; GDN states only)."""
    b = handles.shape[0]
    pages, lens = jnp.zeros((b, 1), jnp.int32), jnp.ones((b,), jnp.int32)
    return ArenaCache(buf, table, handles, pages, lens, spec, kernels)


def build(spec: ArenaSpec, layers: int):
    """The four jitted steps (storage donated, returned updated) and their initialisers."""

    def layer_inputs(inputs, i):
        return [a[i] for a in inputs]

    def native(storage, *inputs):
        ssm, conv = storage
        acc = jnp.float32(0)
        for i in range(layers):
            a, s, c = gdn_token(ssm[i], conv[i], *layer_inputs(inputs, i))
            ssm, conv, acc = ssm.at[i].set(s), conv.at[i].set(c), acc + a
        return (ssm, conv), acc

    def pooled(storage, slots, *inputs):
        ssm, conv = storage
        acc = jnp.float32(0)
        for i in range(layers):
            a, s, c = gdn_token(ssm[i, slots], conv[i, slots], *layer_inputs(inputs, i))
            ssm, conv, acc = ssm.at[i, slots].set(s), conv.at[i, slots].set(c), acc + a
        return (ssm, conv), acc

    def arena(buf, *inputs, table, handles):
        cache = arena_cache(buf, table, handles, spec)
        acc = jnp.float32(0)
        for i in range(layers):
            conv, ssm = cache.gdn_state(i)
            a, s, c = gdn_token(ssm, conv, *layer_inputs(inputs, i))
            cache, acc = cache.with_gdn_state(i, c, s), acc + a
        return cache.buffer, acc

    kernels = ArenaKernels(decode=True, interpret=jax.default_backend() != "gpu")

    def arena_kernel(buf, *inputs, table, handles):
        cache = arena_cache(buf, table, handles, spec, kernels)
        acc = jnp.float32(0)
        for i in range(layers):
            q, k, v, g, beta, x = layer_inputs(inputs, i)
            conv = cache.gdn_conv_state(i)
            # the conv read before the kernel writes the arena in place (else XLA may keep the
            # old value in a copy of the whole arena; see build_prefill)
            conv, buf = lax.optimization_barrier((conv, cache.buffer))
            cache = dataclasses.replace(cache, buffer=buf)
            o, cache = cache.gdn_step_rule(i)(
                q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], use_qk_l2norm=True
            )
            new_conv = jnp.concatenate([conv[:, 1:], x[:, None].astype(conv.dtype)], axis=1)
            a = jnp.sum(o, dtype=jnp.float32) + jnp.sum(new_conv[:, -1], dtype=jnp.float32) * 1e-3
            cache, acc = cache.with_gdn_conv_state(i, new_conv), acc + a
        return cache.buffer, acc

    return tuple(jax.jit(f, donate_argnums=0) for f in (native, pooled, arena, arena_kernel))


def run(args) -> list[dict]:
    layout = layout_for(str(args.config), args.page_size, num_layers=args.num_layers)
    hk = layout.k_heads
    spec = ArenaSpec.from_layout(layout, jnp.bfloat16)
    lg = spec.gdn_layers
    hv, kd, vd = spec.state_shape
    native_j, pooled_j, arena_j, kernel_j = build(spec, lg)
    slot_bytes = lg * (hv * kd * vd * 4 + int(np.prod(spec.conv_shape)) * 2)
    bw = copy_bandwidth(min(1 << 30, max(64 << 20, 4 * slot_bytes)), args.reps)
    rows = []
    for b in args.batch:
        key = jax.random.PRNGKey(b)
        inputs = make_inputs(key, lg, b, spec, hk)
        ssm0 = 0.05 * jax.random.normal(jax.random.PRNGKey(100 + b), (lg, b, hv, kd, vd))
        conv0 = jax.random.normal(
            jax.random.PRNGKey(200 + b), (lg, b, *spec.conv_shape), jnp.bfloat16
        )
        times = {}
        # native: dense [L, B, ...]
        times["native"] = median_time(native_j, (ssm0 + 0, conv0 + 0), inputs, args.reps)
        # pooled: 2B slots, the batch at the odd ones
        slots = jnp.arange(1, 2 * b, 2, dtype=jnp.int32)
        pool = (
            jnp.zeros((lg, 2 * b, hv, kd, vd), jnp.float32).at[:, slots].set(ssm0),
            jnp.zeros((lg, 2 * b, *spec.conv_shape), jnp.bfloat16).at[:, slots].set(conv0),
        )
        times["pooled"] = median_time(pooled_j, pool, (slots, *inputs), args.reps)
        del pool
        buf, table, live = sparse_arena(layout, ssm0, conv0)
        first = jnp.copy(buf)
        times["arena"] = median_time(
            functools.partial(arena_j, table=table, handles=live), buf, inputs, args.reps
        )
        # the kernel path from the same starting arena; one step of each must agree
        step = functools.partial(arena_j, table=table, handles=live)
        ref_buf, ref_acc = step(jnp.copy(first), *inputs)
        kstep = functools.partial(kernel_j, table=table, handles=live)
        k_buf, k_acc = kstep(jnp.copy(first), *inputs)
        row_err = float(jnp.abs(k_acc - ref_acc) / jnp.maximum(jnp.abs(ref_acc), 1e-6))
        del ref_buf, k_buf
        times["arena_kernel"] = median_time(kstep, first, inputs, args.reps)
        del buf
        moved = 2 * b * slot_bytes
        row = dict(
            batch=b, gdn_layers=lg, bytes_moved=moved, floor_s=moved / bw, copy_bandwidth_Bps=bw
        )
        for name, t in times.items():
            row[f"{name}_s"] = t
            row[f"{name}_GBps"] = moved / t / 1e9
        row["pooled_over_native"] = times["pooled"] / times["native"]
        row["arena_over_native"] = times["arena"] / times["native"]
        row["arena_over_pooled"] = times["arena"] / times["pooled"]
        row["kernel_over_arena"] = times["arena_kernel"] / times["arena"]
        row["kernel_rel_err_vs_arena"] = row_err
        rows.append(row)
        print(f"batch {b}: done", file=sys.stderr)
    return rows


# ------------------------------------------------------------------------------ prefill step

STATE_TOL = 1e-3  # f32 final states: max |kernel - arena| / max |arena|
OUT_TOL = 1e-2  # bf16 outputs (one bf16 ulp is 2**-8 of the value)


def make_prefill_inputs(key, layers, b, t, spec: ArenaSpec, hk: int):
    """``q, k [L, B, T, Hk, K]``, ``v [L, B, T, Hv, V]`` (bf16), ``g, beta [L, B, T, Hv]`` f32 and
    the conv tail ``[L, B, W-1, C]`` (the chunk's last pre-conv inputs, the new conv state)."""
    hv, kd, vd = spec.state_shape
    ks = jax.random.split(key, 6)
    q = jax.random.normal(ks[0], (layers, b, t, hk, kd), jnp.bfloat16)
    k = jax.random.normal(ks[1], (layers, b, t, hk, kd), jnp.bfloat16)
    v = jax.random.normal(ks[2], (layers, b, t, hv, vd), jnp.bfloat16)
    g = -jax.random.uniform(ks[3], (layers, b, t, hv), jnp.float32, 0.01, 0.5)
    beta = jax.random.uniform(ks[4], (layers, b, t, hv), jnp.float32, 0.1, 0.9)
    tail = jax.random.normal(ks[5], (layers, b, *spec.conv_shape), jnp.bfloat16)
    return q, k, v, g, beta, tail


def prefill_bytes(spec: ArenaSpec, layers: int, b: int, t: int, hk: int) -> int:
    """Bytes one prefill step must move: state and conv read + write, the inputs read and the
    output written (bf16 q/k/v/o, f32 g/beta)."""
    hv, kd, vd = spec.state_shape
    conv = int(np.prod(spec.conv_shape)) * 2
    state = hv * kd * vd * 4
    per_token = 2 * hk * kd * 2 + hv * vd * 2 + 2 * hv * 4 + hv * vd * 2
    return layers * b * (2 * state + 3 * conv + t * per_token)


def build_prefill(spec: ArenaSpec, layers: int, impl: str):
    """The three jitted prefill steps ``(storage, *inputs) -> (storage, (outputs, acc))``,
    storage donated; ``outputs`` holds each layer's ``o``, ``acc`` a sum over the conv states
    read (so they are not dead)."""

    def rule(q, k, v, g, beta, ssm):
        return chunk_gated_delta_rule(q, k, v, g, beta, ssm, use_qk_l2norm=True, impl=impl)

    def conv_acc(conv):
        return jnp.sum(conv[:, -1], dtype=jnp.float32) * 1e-3

    def native(storage, *inputs):
        ssm, conv = storage
        outs, acc = [], jnp.float32(0)
        for i in range(layers):
            q, k, v, g, beta, tail = (a[i] for a in inputs)
            o, s = rule(q, k, v, g, beta, ssm[i])
            acc = acc + conv_acc(conv[i])
            ssm, conv = ssm.at[i].set(s), conv.at[i].set(tail)
            outs.append(o)
        return (ssm, conv), (tuple(outs), acc)

    def cache_for(buf, table, handles, kernels=XLA_KERNELS):
        return arena_cache(buf, table, handles, spec, kernels)

    def arena(buf, *inputs, table, handles):
        cache = cache_for(buf, table, handles)
        outs, acc = [], jnp.float32(0)
        for i in range(layers):
            q, k, v, g, beta, tail = (a[i] for a in inputs)
            conv, ssm = cache.gdn_state(i)
            o, s = rule(q, k, v, g, beta, ssm)
            # The conv read feeds only `acc` (the new conv is `tail`): tie it to the state write
            # so XLA reads it before the in-place scatters, not from a copy of the whole arena.
            conv, s = lax.optimization_barrier((conv, s))
            cache, acc = cache.with_gdn_state(i, tail, s), acc + conv_acc(conv)
            outs.append(o)
        return cache.buffer, (tuple(outs), acc)

    kernels = ArenaKernels(prefill=True, interpret=jax.default_backend() != "gpu")

    def arena_kernel(buf, *inputs, table, handles):
        cache = cache_for(buf, table, handles, kernels)
        b, t = inputs[0].shape[1:3]
        num_tokens = jnp.full((b,), t, jnp.int32)
        outs, acc = [], jnp.float32(0)
        for i in range(layers):
            q, k, v, g, beta, tail = (a[i] for a in inputs)
            conv = cache.gdn_conv_state(i)
            # as in `arena`: the conv read before the kernel writes the arena in place
            conv, buf = lax.optimization_barrier((conv, cache.buffer))
            cache = dataclasses.replace(cache, buffer=buf)
            o, cache = cache.gdn_prefill_rule(i, num_tokens)(q, k, v, g, beta, use_qk_l2norm=True)
            cache, acc = cache.with_gdn_conv_state(i, tail), acc + conv_acc(conv)
            outs.append(o)
        return cache.buffer, (tuple(outs), acc)

    @functools.partial(jax.jit, static_argnums=4)
    def layer_diff(buf_a, buf_b, table, handles, i):
        ca, cb = cache_for(buf_a, table, handles), cache_for(buf_b, table, handles)
        sa, sb = ca.gdn_state(i)[1], cb.gdn_state(i)[1]
        return jnp.max(jnp.abs(sa - sb)), jnp.max(jnp.abs(sb))

    def state_diff(buf_a, buf_b, table, handles):
        """``(max |a - b|, max |b|)`` over every layer's recurrent state of the rows, one layer
        per program: one program over all 30 layers asked XLA for 257 GiB at B 64 on the H200."""
        diff = ref = 0.0
        for i in range(layers):
            d, r = layer_diff(buf_a, buf_b, table, handles, i)
            diff, ref = max(diff, float(d)), max(ref, float(r))
        return diff, ref

    steps = tuple(jax.jit(f, donate_argnums=0) for f in (native, arena, arena_kernel))
    return (*steps, state_diff)


def out_diff(outs_a, outs_b) -> tuple[float, float]:
    """``(max |a - b|, max |b|)`` over every layer's output (f32)."""
    diff = ref = 0.0
    for a, b in zip(outs_a, outs_b, strict=True):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        diff = max(diff, float(jnp.max(jnp.abs(a - b))))
        ref = max(ref, float(jnp.max(jnp.abs(b))))
    return diff, ref


def run_prefill(args, on_row=None) -> tuple[list[dict], dict]:
    """The prefill rows and the run's metadata; ``on_row(rows, meta)`` after every row (so a
    run cut short by a time limit keeps what it measured)."""
    layout = layout_for(str(args.config), args.page_size, num_layers=args.num_layers)
    hk = layout.k_heads
    spec = ArenaSpec.from_layout(layout, jnp.bfloat16)
    lg = spec.gdn_layers
    hv, kd, vd = spec.state_shape
    native_j, arena_j, kernel_j, state_diff = build_prefill(spec, lg, args.prefill_impl)
    slot_bytes = lg * (hv * kd * vd * 4 + int(np.prod(spec.conv_shape)) * 2)
    if args.bandwidth:
        bw = args.bandwidth * 1e9
    else:
        bw = copy_bandwidth(min(1 << 30, max(64 << 20, 4 * slot_bytes)), args.reps)
    rows = []
    meta = dict(
        step="prefill",
        prefill_impl=args.prefill_impl,
        chunk_impl=None,
        state_tol=STATE_TOL,
        out_tol=OUT_TOL,
    )
    for b in args.batch:
        ssm0 = 0.05 * jax.random.normal(jax.random.PRNGKey(100 + b), (lg, b, hv, kd, vd))
        conv0 = jax.random.normal(
            jax.random.PRNGKey(200 + b), (lg, b, *spec.conv_shape), jnp.bfloat16
        )
        first, table, live = sparse_arena(layout, ssm0, conv0)
        astep = functools.partial(arena_j, table=table, handles=live)
        kstep = functools.partial(kernel_j, table=table, handles=live)
        for t in args.chunk:
            inputs = make_prefill_inputs(jax.random.PRNGKey(1000 * b + t), lg, b, t, spec, hk)
            resolved = resolve_impl(args.prefill_impl, "chunk_gated_delta_rule", *inputs[:3], 64)
            times = {}
            if not args.no_native:
                times["native"] = median_time(native_j, (ssm0 + 0, conv0 + 0), inputs, args.reps)
            # one step of each from the same starting arena: final states and outputs must agree
            ref_buf, (ref_o, _) = astep(jnp.copy(first), *inputs)
            k_buf, (k_o, _) = kstep(jnp.copy(first), *inputs)
            sd, sr = (float(x) for x in state_diff(k_buf, ref_buf, table, live))
            od, orf = out_diff(k_o, ref_o)
            del ref_buf, k_buf, ref_o, k_o
            times["arena"] = median_time(astep, jnp.copy(first), inputs, args.reps)
            times["arena_kernel"] = median_time(kstep, jnp.copy(first), inputs, args.reps)
            moved = prefill_bytes(spec, lg, b, t, hk)
            row = dict(batch=b, chunk=t, gdn_layers=lg, chunk_impl=resolved, bytes_moved=moved)
            row.update(floor_s=moved / bw, copy_bandwidth_Bps=bw)
            for name, s in times.items():
                row[f"{name}_s"] = s
                row[f"{name}_GBps"] = moved / s / 1e9
            if "native" in times:
                row["arena_over_native"] = times["arena"] / times["native"]
                row["kernel_over_native"] = times["arena_kernel"] / times["native"]
            row["kernel_over_arena"] = times["arena_kernel"] / times["arena"]
            row["kernel_over_floor"] = times["arena_kernel"] / row["floor_s"]
            row["state_max_abs_diff"] = sd
            row["state_rel_err"] = sd / max(sr, 1e-30)
            row["out_max_abs_diff"] = od
            row["out_rel_err"] = od / max(orf, 1e-30)
            row["exact"] = row["state_rel_err"] <= STATE_TOL and row["out_rel_err"] <= OUT_TOL
            rows.append(row)
            meta["chunk_impl"] = resolved
            if on_row is not None:
                on_row(rows, meta)
            print(f"batch {b} chunk {t}: done", file=sys.stderr)
        del first
    return rows, meta


def prefill_table(rows: list[dict], device: str) -> str:
    impl = rows[0]["chunk_impl"] if rows else "?"
    head = (
        "| B | T | GDN layers | bytes / step | floor ms | native ms | arena (windows) ms "
        "| arena kernel ms | kernel / arena | kernel / floor | state max diff | state rel "
        "| out max diff | out rel |"
    )
    lines = [f"device: {device}; arena/native chunked rule: {impl}", head, "|" + " --- |" * 14]
    for r in rows:
        native = f"{1e3 * r['native_s']:.2f}" if "native_s" in r else "-"
        lines.append(
            f"| {r['batch']} | {r['chunk']} | {r['gdn_layers']} | {r['bytes_moved'] / 2**20:.0f} MiB "
            f"| {1e3 * r['floor_s']:.2f} | {native} | {1e3 * r['arena_s']:.2f} "
            f"| {1e3 * r['arena_kernel_s']:.2f} | {r['kernel_over_arena']:.2f} "
            f"| {r['kernel_over_floor']:.1f} | {r['state_max_abs_diff']:.1e} "
            f"| {r['state_rel_err']:.1e} | {r['out_max_abs_diff']:.1e} | {r['out_rel_err']:.1e} |"
        )
    return "\n".join(lines)


def table(rows: list[dict], device: str) -> str:
    head = (
        "| batch | GDN layers | state bytes / step | floor ms | native ms | pooled ms "
        "| arena ms | arena GB/s | pooled / native | arena / native | arena / pooled "
        "| arena kernel ms | kernel / arena | kernel rel err |"
    )
    lines = [f"device: {device}", head, "|" + " --- |" * 14]
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['gdn_layers']} | {r['bytes_moved'] / 2**20:.0f} MiB "
            f"| {1e3 * r['floor_s']:.2f} | {1e3 * r['native_s']:.2f} "
            f"| {1e3 * r['pooled_s']:.2f} | {1e3 * r['arena_s']:.2f} | {r['arena_GBps']:.1f} "
            f"| {r['pooled_over_native']:.2f} | {r['arena_over_native']:.2f} "
            f"| {r['arena_over_pooled']:.2f} | {1e3 * r['arena_kernel_s']:.2f} "
            f"| {r['kernel_over_arena']:.2f} | {r['kernel_rel_err_vs_arena']:.1e} |"
        )
    return "\n".join(lines)


def sparse_arena(layout, ssm0, conv0):
    """``(buffer, table, handles)``: an arena with room for 2B states, every other one freed
    (non-contiguous), the B live ones holding ``ssm0, conv0 [Lg, B, ...]``; the manager is
    dropped and the buffer handed over."""
    b = ssm0.shape[1]
    mm, handles = arena_with_states(layout, 2 * b)
    for i in range(0, 2 * b, 2):
        mm.free(("req", i))
    live = jnp.asarray(handles[1::2], jnp.int32)
    for i, h in enumerate(handles[1::2]):
        mm.write("state", h, ssm0[:, i], field="recurrent")
        mm.write("state", h, conv0[:, i], field="conv")
    table = mm.device_table()
    buf, mm.arena.buffer = mm.arena.buffer, None
    return buf, table, live


def arena_with_states(layout, count: int):
    """A manager holding ``count`` live state units (budget grown until segment rounding fits)."""
    budget = int(count * layout.state_slot_bytes * 1.05) + (1 << 20)
    while True:
        mm = MemoryManager(layout, budget)
        try:
            return mm, [mm.alloc(("req", i), "state")[0] for i in range(count)]
        except OutOfMemoryError:
            del mm
            budget = int(budget * 1.25)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.arena_read",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--config", type=Path, default=CONFIG, help="HF config.json (default: %(default)s)"
    )
    p.add_argument(
        "--num-layers",
        type=int,
        default=None,
        help="keep the first N layers of the pattern (default: all)",
    )
    p.add_argument("--batch", type=ints, default=[1, 16, 64], help="batch sizes (default: 1,16,64)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=20, help="timed calls per cell (median)")
    p.add_argument("--json", type=Path, default=None, help="write the rows here")
    p.add_argument(
        "--step",
        choices=("decode", "prefill"),
        default="decode",
        help="one decode token (default) or one prefill chunk of --chunk tokens per row",
    )
    p.add_argument(
        "--chunk", type=ints, default=[16, 64], help="prefill: tokens per row (default: 16,64)"
    )
    p.add_argument(
        "--prefill-impl",
        choices=("auto", "xla", "pallas"),
        default="auto",
        help="prefill: impl of the native/arena chunked rule (default: auto, as the engine)",
    )
    p.add_argument("--no-native", action="store_true", help="prefill: skip the dense reference")
    p.add_argument(
        "--bandwidth", type=float, default=None, help="floor bandwidth in GB/s (default: measured)"
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny CPU run: 4 layers (3 GDN), batch 1,2, chunk 16, 2 reps",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.num_layers, args.batch, args.chunk, args.reps = 4, [1, 2], [16], 2
    device = str(jax.devices()[0].device_kind)
    if args.step == "prefill":

        def dump(rows, meta):
            if args.json:
                args.json.write_text(json.dumps(dict(device=device, **meta, rows=rows), indent=2))

        rows, meta = run_prefill(args, dump)
        dump(rows, meta)
        print(prefill_table(rows, device))
        bad = [(r["batch"], r["chunk"]) for r in rows if not r["exact"]]
        if bad:
            raise SystemExit(f"arena prefill kernel disagrees with the XLA windows at (B, T) {bad}")
        return
    rows = run(args)
    print(table(rows, device))
    if args.json:
        args.json.write_text(json.dumps(dict(device=device, rows=rows), indent=2))


if __name__ == "__main__":
    main()
